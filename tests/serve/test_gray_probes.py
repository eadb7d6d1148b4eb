"""The ingress's probes (``pd.serve.probes``) of quarantined and suspect replicas, with the tests' own clock.

A prefill pool of two in simulated seconds: the detector (``router.gray``)
judges it once a second, its verdicts reach a ``PoolRouting`` as the router's
watch publishes them, and ``QuarantineProbes.run_round`` probes through a
fake prefill handle that computes the probe's prompt on the simulated
replica. No Ray, no process.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pd.serve.probes import QuarantineProbes
from pd.serve.protocol import PoolControl, PoolRequest, PrefillResult
from router.gray import PREFILL_PROBE_TOKENS, GrayFailureConfig, GrayFailureDetector
from router.protocol import RouteHints
from router.shared import PoolRouting
from tests.router.test_gray_prefill import PrefillReplica, run

INTERVAL_S = GrayFailureConfig().probe_interval_s
USER_LENGTHS = itertools.cycle((600, 1000, 1400))  # a's prompts: three lengths make the fitted law exact


def user_prompts(b_at=()):
    """a gets a user prompt every second; b only at the seconds ``b_at``."""
    return lambda replica_id, t: [next(USER_LENGTHS)] if replica_id == "a" else [1000] if t in b_at else []


class _Remote:
    def __init__(self, call):
        self.remote = call


class FakePrefillHandle:
    """Serves a probe on the simulated replica it is pinned to: computes its prompt, answers its first token."""

    def __init__(self, replicas: dict[str, PrefillReplica]):
        self.replicas = replicas
        self.probes: list[tuple[str, int]] = []  # (replica, prompt tokens)
        self.prompts: list[tuple[int, ...]] = []
        self.released: list[str] = []
        self.prefill = _Remote(self._prefill)
        self.release = _Remote(self._release)

    async def _prefill(self, hints: bytes, request: bytes) -> bytes:
        target = RouteHints.decode(hints).target_replica_id
        prompt = PoolRequest.decode(request).token_ids
        self.replicas[target].prefill(len(prompt))
        self.probes.append((target, len(prompt)))
        self.prompts.append(prompt)
        return PrefillResult(request_id=PoolRequest.decode(request).request_id, replica_id=target,
                             first_token_id=1, first_logprob=None, kv_handle=b"", num_cached_tokens=0).encode()

    async def _release(self, hints: bytes, control: bytes) -> None:
        self.released.append(PoolControl.decode(control).request_id)


def run_pool(seconds: int, prompts, start_s: int, detector, replicas, routing, probes) -> list:
    """Each simulated second: user prompts (``prompts(replica_id, t)``), reports and a judgment published to
    ``routing`` as the router's watch does, then a probe round at the ingress's period."""
    changes = []
    for t in range(start_s + 1, start_s + seconds + 1):
        changes += run(detector, replicas, 1, prompts, t - 1)
        routing.quarantined = frozenset(detector.quarantined())
        routing.slowness = {r: detector.slowness(r) for r in replicas}
        if t % int(INTERVAL_S) == 0:
            asyncio.run(probes.run_round(float(t)))
    return changes


@pytest.fixture
def pool():
    replicas = {"a": PrefillReplica(), "b": PrefillReplica(slowdown=5.0)}
    handle = FakePrefillHandle(replicas)
    routing = PoolRouting()
    probes = QuarantineProbes({"prefill": (routing, handle, INTERVAL_S)})
    return GrayFailureDetector(), replicas, routing, probes, handle


def test_a_slow_prefill_replica_the_router_starved_is_probed_quarantined_and_readmitted(pool):
    """b, 5x slow, gets one prompt and then none (the router sends them to a). Its reading makes it a
    suspect; the probes confirm it, one every probe_interval_s, and once it recovers they readmit it."""
    detector, replicas, routing, probes, handle = pool
    changes = run_pool(30, user_prompts(b_at=(1,)), 0, detector, replicas, routing, probes)
    assert [(c.replica_id, c.kind) for c in changes] == [("b", "quarantined")]
    assert changes[0].at_s == 11.0 and changes[0].slowness == pytest.approx(5.0, rel=1e-6)
    # Judged from its one prompt at t=1; probed from the first round it was a suspect (t=5), once a round,
    # each probe a fresh prompt computed whole; its probes' reports at t=6 and t=11 complete the window.
    assert handle.probes == [("b", PREFILL_PROBE_TOKENS)] * 6
    assert len(set(handle.prompts)) == 6 and len(handle.released) == 6
    replicas["b"].slowdown = 1.0  # the fault ends; only probes measure b while it is quarantined
    # Its probes' reports judged at t=36, 41 and 46 read 2.3x (the slow probe of t=30 decayed into it), 1.4x
    # and less: at t=46 the window's higher median is 1.4x, under readmit_factor (1.5x).
    changes = run_pool(40, user_prompts(), 30, detector, replicas, routing, probes)
    assert [(c.replica_id, c.kind, c.at_s) for c in changes] == [("b", "readmitted", 46.0)]
    assert detector.probe_targets() == [] and len(handle.probes) == 9  # none since it was readmitted


def test_without_probes_the_starved_replica_is_never_judged(pool):
    """The same pool with no probe rounds: b stays a suspect and goes stale, never quarantined."""
    detector, replicas, routing, _, handle = pool
    changes = run(detector, replicas, 60, user_prompts(b_at=(1,)))
    assert changes == [] and handle.probes == []
    assert detector.probe_targets() == ["b"] and detector.slowness("b") == pytest.approx(5.0, rel=1e-6)


def test_a_healthy_pool_is_not_probed(pool):
    detector, replicas, routing, probes, handle = pool
    replicas["b"].slowdown = 1.0
    changes = run_pool(60, user_prompts(b_at=range(0, 61, 3)), 0, detector, replicas, routing, probes)
    assert changes == [] and handle.probes == [] and probes.num_probes == 0
