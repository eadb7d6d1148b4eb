"""The engine's side of disaggregation.

Prefill role: a request marked ``pin_kv`` finishes after its first token with
its blocks pinned under a lease, and the engine hands out a ``KVHandle``. The
lease ends on the decode side's completion notification, an explicit release
(abort, or no decode needed), or expiry.

Decode role: a request carrying ``remote_kv`` is admitted with its blocks
allocated, and the blocks this engine's own prefix cache lacks are pulled from
the prefill replica. A pull that fails, times out or meets an expired lease
sends the request back to compute its prompt here; that is counted. Between
engines of different tensor-parallel splits every rank gets the KV heads it
owns: the first rank holding a head reads it from the prefill rank that holds
it, and ranks holding the same head copy it from that rank's pool
(``pd.engine.disagg.pulls``); the lease ends on one notification once every
read from the prefill engine is done.

Safety: a pull holds its own reference on the local blocks it writes, from
its start until its handle is quiesced (``transfer.base``). A pull given up
(an abort, its deadline) releases its handle, and its blocks stay out of the
free list until no byte can still land in them, so late bytes never land in
blocks another request owns. A pull's deadline never passes its lease's
expiry, so the prefill side never frees blocks that a pull still counts on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from pd.engine.clock import SYSTEM_CLOCK, Clock
from pd.engine.disagg.lease import LeaseTable
from pd.engine.disagg.pulls import start_split_pull
from pd.engine.kv_cache_manager import KVCacheManager
from pd.engine.request import Request
from pd.engine.scheduler import Scheduler
from pd.engine.tp.driver import TPWorkers
from pd.lora import AdapterId
from pd.model.config import ModelConfig
from transfer.base import DelayedRead, KVTransport, TransferHandle, TransferState
from transfer.wire import KVHandle, LayoutFingerprint, WireError, prompt_digest

logger = logging.getLogger(__name__)

# A handle whose lease ends sooner than this is not worth starting a pull for.
MIN_LEASE_MARGIN_S = 0.5
# Fault injection for tests (tests/serve/test_localisation.py): every pull's read is posted this many
# seconds late (``transfer.base.DelayedRead``), as over a link that stalled. Unset in service.
FAULT_PULL_DELAY_ENV = "PD_FAULT_KV_PULL_DELAY_S"


def _fault_pull_delay_s() -> float:
    """``PD_FAULT_KV_PULL_DELAY_S`` in seconds (0 when unset); a value that is not a number >= 0 is refused."""
    value = os.environ.get(FAULT_PULL_DELAY_ENV, "") or "0"
    try:
        delay = float(value)
    except ValueError:
        delay = -1.0
    if not delay >= 0:
        raise ValueError(f"{FAULT_PULL_DELAY_ENV} must be a number of seconds >= 0, got {value!r}")
    return delay


@dataclass
class _Pull:
    request: Request
    handle: TransferHandle
    started: float  # clock.monotonic()
    deadline: float
    block_ids: list[int]  # the local blocks it writes, each with a reference held by the pull


@dataclass
class ConnectorTP:
    """What the connector of a tensor-parallel engine needs beyond its rank 0's transport."""

    size: int  # the engine's ranks: each reads the KV heads its attention runs on
    model_config: ModelConfig
    workers: TPWorkers | None  # the driver's ranks 1..N-1
    # The transports' metadata of ranks 1..attention_size-1, for the handles it hands out.
    rank_metadata: Callable[[], list[bytes]]
    # The ranks attention is split over: ``size``, or 1 where every (expert-parallel) rank holds it whole.
    attention_size: int = 1


@dataclass
class ConnectorStats:
    num_pinned_leases: int = 0
    num_leases_expired: int = 0
    num_remote_pulls: int = 0
    num_pulled_blocks: int = 0
    num_pulled_bytes: int = 0
    pull_seconds_total: float = 0.0
    num_recompute_fallbacks: int = 0
    num_quarantined_blocks: int = 0  # blocks of given-up pulls, held until no byte can land


class KVConnector:
    def __init__(
        self,
        engine_id: str,
        transport: KVTransport | None,
        fingerprint: LayoutFingerprint,
        kv_cache: KVCacheManager,
        scheduler: Scheduler,
        lease_s: float,
        read_timeout_s: float,
        block_bytes: int,
        clock: Clock = SYSTEM_CLOCK,
        tp: ConnectorTP | None = None,
    ):
        self.engine_id = engine_id
        self.tp = tp
        self.transport = transport
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.clock = clock
        # The engine's own state that requests and blocks move through.
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.stats = ConnectorStats()
        self.fault_pull_delay_s = _fault_pull_delay_s()
        # Prefill role: finished prompts whose blocks stay pinned under a lease.
        self.lease_s = lease_s
        self.leases = LeaseTable()
        self._pinned: dict[str, Request] = {}
        # Decode role: pulls in flight, given-up pulls not yet quiesced, and the peers pulled from.
        self.read_timeout_s = read_timeout_s
        self._pulls: dict[str, _Pull] = {}
        self._quarantine: list[_Pull] = []
        self._peer_metadata: dict[str, bytes] = {}
        self._peer_names: dict[str, str] = {}
        self._rank_peers: dict[bytes, str] = {}  # prefill ranks' transports, for pulls across TP splits

    @property
    def has_pending_work(self) -> bool:
        return bool(self._pinned or self._pulls or self._quarantine)

    def require_transport(self) -> KVTransport:
        if self.transport is None:
            raise ValueError("this engine has no KV transport; disaggregated requests need one")
        return self.transport

    # Prefill role ---------------------------------------------------------

    def pin(self, request: Request) -> bytes:
        """Keep a finished prefill's blocks under a lease and describe them in a KVHandle."""
        transport = self.require_transport()
        expiry = self.clock.wall() + self.lease_s
        self.leases.pin(request.request_id, expiry)
        self._pinned[request.request_id] = request
        self.stats.num_pinned_leases = len(self.leases)
        return KVHandle(
            request_id=request.request_id,
            engine_id=self.engine_id,
            transport=transport.kind,
            peer_metadata=transport.local_metadata(),
            block_ids=tuple(self.kv_cache.block_ids(request.request_id)[: self._num_prompt_blocks(request)]),
            num_tokens=request.num_prompt_tokens,
            block_size=self.kv_cache.block_size,
            fingerprint=self.fingerprint,
            first_token_id=request.output_token_ids[0],
            lease_expiry=expiry,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            rank_metadata=tuple(self.tp.rank_metadata()) if self.tp is not None else (),
            adapter=request.lora.name if request.lora is not None else "",
            adapter_digest=request.lora.digest if request.lora is not None else "",
        ).encode()

    def release(self, request_id: str) -> bool:
        """End a lease and free its blocks; False when there was none (idempotent)."""
        request = self._pinned.pop(request_id, None)
        self.leases.release(request_id)
        self.stats.num_pinned_leases = len(self.leases)
        if request is None:
            return False
        self.kv_cache.free(request)
        return True

    def _num_prompt_blocks(self, request: Request) -> int:
        return -(-request.num_prompt_tokens // self.kv_cache.block_size)

    # Decode role ----------------------------------------------------------

    def accept(self, handle: KVHandle, prompt_token_ids: list[int], lora: AdapterId | None = None) -> bool:
        """Check a handle before anything moves; False means recompute locally instead.

        A handle for a different layout, transport, prompt or adapter is refused with ``WireError``.
        """
        self.check(handle, prompt_token_ids, lora)
        if handle.lease_expiry - self.clock.wall() < MIN_LEASE_MARGIN_S:
            self.note_fallback()
            logger.warning("request %s: KV lease already expired; recomputing locally", handle.request_id)
            return False
        return True

    def check(self, handle: KVHandle, prompt_token_ids: list[int], lora: AdapterId | None = None) -> None:
        """``WireError`` unless ``handle`` holds this prompt's KV in this engine's layout and transport, computed
        under the LoRA adapter ``lora`` (its name and digest; None: the base model)."""
        transport = self.require_transport()
        self.fingerprint.check_compatible(handle.fingerprint)
        if handle.transport != transport.kind:
            raise WireError(f"kv_handle.transport is {handle.transport.value!r} but this engine uses "
                            f"{transport.kind.value!r}")
        if handle.num_tokens != len(prompt_token_ids):
            raise WireError(f"kv_handle covers {handle.num_tokens} tokens but the prompt has {len(prompt_token_ids)}")
        if handle.prompt_digest != prompt_digest(prompt_token_ids):
            raise WireError("kv_handle is for another prompt of the same length")
        adapter = ("", "") if lora is None else (lora.name, lora.digest)
        if (handle.adapter, handle.adapter_digest) != adapter:
            raise WireError(f"kv_handle was computed under LoRA adapter {handle.adapter or 'none'!r} "
                            f"(digest {handle.adapter_digest[:12] or '-'}), this request runs under "
                            f"{adapter[0] or 'none'!r} (digest {adapter[1][:12] or '-'})")

    def start_pulls(self, requests: list[Request]) -> None:
        for request in requests:
            try:
                self._start_pull(request)
            except Exception as exc:  # noqa: BLE001 - any failure to start means recompute
                logger.warning("request %s: cannot start KV pull (%s); recomputing locally", request.request_id, exc)
                self._fall_back(request)

    def _start_pull(self, request: Request) -> None:
        handle = request.remote_kv
        transport = self.require_transport()
        peer = self._peer(handle)
        num_hit_blocks = request.num_computed_tokens // self.kv_cache.block_size
        local = self.kv_cache.block_ids(request.request_id)[num_hit_blocks : len(handle.block_ids)]
        remote = handle.block_ids[num_hit_blocks:]
        lease_left = handle.lease_expiry - self.clock.wall() - MIN_LEASE_MARGIN_S
        started = self.clock.monotonic()
        deadline = started + min(self.read_timeout_s, max(lease_left, 0.0))
        local_size = self.tp.size if self.tp is not None else 1

        def issue() -> TransferHandle:
            if handle.fingerprint.tensor_parallel_size == 1 and local_size == 1:
                return transport.read_blocks(peer, remote, local, notify=handle.request_id)  # the prefill's lease
            # every rank reads its heads from the prefill ranks that hold them
            return start_split_pull(handle, self.tp.model_config, transport, self.tp.workers, local_size,
                                    self._peer_of, list(remote), list(local), self.tp.attention_size)

        delay = self.fault_pull_delay_s
        transfer = DelayedRead(issue, delay, self.clock.monotonic) if delay > 0 else issue()
        self.kv_cache.touch_blocks(local)
        self._pulls[request.request_id] = _Pull(request, transfer, started, deadline, list(local))
        self.stats.num_remote_pulls += 1

    def _peer(self, handle: KVHandle) -> str:
        """Add the peer on first contact, and again when it restarted with new metadata."""
        if self._peer_metadata.get(handle.engine_id) != handle.peer_metadata:
            self._peer_names[handle.engine_id] = self.transport.add_peer(handle.peer_metadata)
            self._peer_metadata[handle.engine_id] = handle.peer_metadata
        return self._peer_names[handle.engine_id]

    def _peer_of(self, metadata: bytes) -> str:
        """A prefill rank's transport, added on first contact (by its metadata: a restart changes it)."""
        if metadata not in self._rank_peers:
            name = self.transport.add_peer(metadata)
            for stale in [key for key, known in self._rank_peers.items() if known == name]:
                del self._rank_peers[stale]  # that rank restarted: its old metadata is dead
            self._rank_peers[metadata] = name
        return self._rank_peers[metadata]

    def note_fallback(self) -> None:
        self.stats.num_recompute_fallbacks += 1

    def _fall_back(self, request: Request) -> None:
        self.note_fallback()
        self.scheduler.finish_remote_read(request, succeeded=False)

    def abort(self, request_id: str) -> None:
        """Give up a pull (its blocks stay held until it is quiesced) or end a lease."""
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            self._end_pull(pull)
        self.release(request_id)

    def _end_pull(self, pull: _Pull) -> None:
        """Drop the pull's hold on its blocks now, or once no byte can still land in them."""
        pull.handle.release()
        if pull.handle.quiesced():
            self.kv_cache.free_blocks(pull.block_ids)
            return
        self._quarantine.append(pull)
        self.stats.num_quarantined_blocks += len(pull.block_ids)

    def _drain_quarantine(self) -> None:
        held = []
        for pull in self._quarantine:
            if pull.handle.quiesced():
                self.kv_cache.free_blocks(pull.block_ids)
                self.stats.num_quarantined_blocks -= len(pull.block_ids)
            else:
                held.append(pull)
        self._quarantine = held

    # Housekeeping, once per step and while idle -----------------------------

    def poll(self) -> None:
        # Once per engine step: each part is skipped when it has nothing to look at.
        if self._quarantine:
            self._drain_quarantine()
        if self.transport is not None:
            for request_id in self.transport.poll_notifications():
                self.release(request_id)
        if self.leases:
            for request_id in self.leases.expired(self.clock.wall()):
                logger.warning("request %s: KV lease expired before the decode side pulled it", request_id)
                self.stats.num_leases_expired += 1
                self.release(request_id)
        if not self._pulls:
            return
        mono = self.clock.monotonic()
        for request_id, pull in list(self._pulls.items()):
            state = pull.handle.poll()
            if state is TransferState.PENDING and mono < pull.deadline:
                continue
            del self._pulls[request_id]
            self._end_pull(pull)
            pull.request.pull_seconds = mono - pull.started  # a failed pull's time too: the request waited
            if state is TransferState.DONE:
                self.stats.num_pulled_blocks += len(pull.block_ids)
                # What the transport measured it moved (NIXL's telemetry); computed where it cannot say.
                moved = pull.handle.moved_bytes
                moved = len(pull.block_ids) * self.block_bytes if moved is None else moved
                self.stats.num_pulled_bytes += moved
                self.stats.pull_seconds_total += mono - pull.started
                pull.request.num_pulled_bytes, pull.request.num_pulled_blocks = moved, len(pull.block_ids)
                pull.request.num_pull_descriptors = getattr(pull.handle, "num_descriptors", 0)
                self.scheduler.finish_remote_read(pull.request, succeeded=True)
            else:
                reason = pull.handle.error if state is TransferState.FAILED else "timed out"
                logger.warning("request %s: KV pull failed (%s); recomputing locally", request_id, reason)
                pull.request.pull_error = str(reason)[:200]
                self._fall_back(pull.request)
