"""The ingress measures its pools' quarantined and suspect replicas with small requests of its own, never a user's.

A quarantined replica (``router.gray``) gets no new user requests, so
nothing it runs would show whether it recovered; a suspect, measured slow on
whatever evidence it had, is often one the router has stopped feeding, so
nothing it runs would confirm it. Every ``probe_interval_s`` the ingress
sends each of them (``router.gray.probe_targets`` of the pool's routing) a
request pinned to it (``RouteHints.target_replica_id``): a short greedy
generation on a decode replica (a cached 32-token prompt, 32 tokens: 32
steps, twice ``min_replica_steps``), a fresh prompt of
``PREFILL_PROBE_TOKENS`` (1,024) tokens on a prefill replica, computed
whole (no block of it is cached) and its lease released at once: twice
``min_replica_tokens`` at most, so one probe is judged. The steps it runs
reach the detector through the replica's reports like any other, and
confirm, clear or readmit it. Probes bypass the ingress's latency metrics;
a probe that fails is logged and tried again at the next interval.

Their cost is bounded: at most one probe per target replica per
``probe_interval_s``, one round at a time, and a replica is a target only
while quarantined (at most ``max_fraction`` of its pool) or measured at
least ``SUSPECT_FACTOR`` (2x) slower than its pool predicts; a probe that
measures it faster clears it. With the defaults a prefill replica computes
at most 1,024 probe tokens every 5 s, about 205 tokens a second, and a
decode replica decodes at most 32 probe tokens every 5 s.

A replica its router marks for replacement (``PoolRouting.replace_due``:
quarantined past ``replace_after_s``) is asked, once, to fail its health
checks; Serve then stops it and starts a new one in its place.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid

from pd.sampling_params import SamplingParams
from pd.serve.protocol import (
    DecodeChunk,
    PoolControl,
    PoolRequest,
    PrefillResult,
    ReplicaReplacement,
    RequestFailed,
)
from router.gray import PREFILL_PROBE_TOKENS, GrayFailureConfig, probe_targets
from router.protocol import RouteHints
from router.shared import PoolRouting
from transfer.wire import decode_one_of

logger = logging.getLogger(__name__)

PROBE_PROMPT = tuple(range(1, 33))  # a decode probe's: two 16-token blocks, cached after the first probe
PROBE_TOKENS = 32
PROBE_TIMEOUT_S = 60.0


def probe_interval_s(gray_failure: dict[str, float] | None) -> float | None:
    """A pool's probe interval, from its router's ``gray_failure`` settings; None when it has none."""
    return None if gray_failure is None else GrayFailureConfig(**gray_failure).probe_interval_s


def prefill_probe_prompt(rng: random.Random) -> tuple[int, ...]:
    """A prefill probe's prompt: ``PREFILL_PROBE_TOKENS`` tokens drawn from the decode probe's (ids every
    vocabulary has), fresh each time, so that no block of it is cached and the replica computes it whole."""
    return tuple(rng.choices(PROBE_PROMPT, k=PREFILL_PROBE_TOKENS))


class QuarantineProbes:
    """Probes the quarantined and suspect replicas of each pool given an interval, until ``close``."""

    def __init__(self, pools: dict[str, tuple[PoolRouting, object, float]]):
        self.pools = pools  # name -> (its routing in this process, its handle, probe interval)
        self._task: asyncio.Task | None = None
        self._last: dict[str, float] = {}
        self.num_probes = 0
        self.replacing: set[str] = set()  # replicas asked to be replaced
        self._rng = random.Random()

    def start(self) -> None:
        """Start on the running event loop, once (the first request's)."""
        if self._task is None and self.pools:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        period = min(interval for _, _, interval in self.pools.values())
        while True:
            await asyncio.sleep(period)  # a timer: the next round of probes
            await self.run_round(time.monotonic())

    async def run_round(self, now_s: float) -> None:
        """One round: probe every target not probed within its pool's interval, ask for due replacements."""
        due = [(name, replica) for name, (routing, _, interval) in self.pools.items()
               for replica in probe_targets(routing.quarantined, routing.slowness)
               if now_s - self._last.get(replica, -math.inf) >= interval]
        for name, replica in due:
            self._last[replica] = now_s
        due_replacement = {replica: (name, why) for name, (routing, _, _) in self.pools.items()
                           for replica, why in routing.replace_due.items()}
        self.replacing &= due_replacement.keys()  # a replaced replica is gone from its routing's list
        replace = [(name, replica, why) for replica, (name, why) in sorted(due_replacement.items())
                   if replica not in self.replacing]
        await asyncio.gather(*(self._probe(name, replica) for name, replica in due),
                             *(self._replace(name, replica, why) for name, replica, why in replace))

    async def _replace(self, pool: str, replica: str, why: str) -> None:
        _, handle, _ = self.pools[pool]
        hints = RouteHints(request_id=f"replace-{uuid.uuid4().hex}", target_replica_id=replica)
        try:
            await asyncio.wait_for(handle.request_replacement.remote(hints.encode(),
                                                                     ReplicaReplacement(reason=why).encode()),
                                   PROBE_TIMEOUT_S)
            self.replacing.add(replica)
            logger.warning("%s replica %s: asked Serve to replace it (%s)", pool, replica, why)
        except Exception as exc:  # noqa: BLE001 - asked again next round
            logger.warning("could not ask %s replica %s to be replaced: %r", pool, replica, exc)

    async def _probe(self, pool: str, replica: str) -> None:
        routing, handle, _ = self.pools[pool]
        request_id = f"probe-{uuid.uuid4().hex}"
        prompt = PROBE_PROMPT if pool == "decode" else prefill_probe_prompt(self._rng)
        hints = RouteHints(request_id=request_id, num_prompt_tokens=len(prompt), target_replica_id=replica)
        params = SamplingParams(max_tokens=PROBE_TOKENS if pool == "decode" else 1, temperature=0.0, ignore_eos=True)
        request = PoolRequest(request_id=request_id, token_ids=prompt, sampling=params)
        held = "quarantined" if routing.is_quarantined(replica) else "suspect"
        try:
            await asyncio.wait_for(self._call(pool, handle, hints, request), PROBE_TIMEOUT_S)
            self.num_probes += 1
            logger.info("probed %s %s replica %s", held, pool, replica)
        except Exception as exc:  # noqa: BLE001 - a probe that fails is tried again next interval
            logger.warning("probe of %s %s replica %s failed: %r", held, pool, replica, exc)

    @staticmethod
    async def _call(pool: str, handle, hints: RouteHints, request: PoolRequest) -> None:
        if pool == "decode":
            stream = handle.options(stream=True).generate.remote(hints.encode(), request.encode())
            try:
                async for data in stream:
                    if DecodeChunk.decode(data).finish_reason is not None:
                        return
            finally:
                stream.cancel()  # a no-op once finished; else the replica aborts the probe
            return
        answer = decode_one_of(await handle.prefill.remote(hints.encode(), request.encode()),
                               (PrefillResult, RequestFailed))
        if isinstance(answer, PrefillResult):
            await handle.release.remote(hints.encode(), PoolControl(request_id=answer.request_id).encode())
