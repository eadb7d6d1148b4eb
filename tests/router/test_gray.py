"""The gray-failure detector (``router.gray``): quarantine a persistently slow replica, probe it, readmit it."""

from __future__ import annotations

import random

import pytest

from router.gray import GrayFailureConfig, GrayFailureDetector
from router.protocol import RoutingStats
from router.step_cost import StepShape, StepSums, linear_seconds

COST = (2e-3, 4e-5, 2e-9, 1e-4, 2e-4)  # base, per token, per pair, per seq, per sample
CONFIG = GrayFailureConfig(window_s=10.0, half_life_s=3.0, probe_interval_s=5.0, replace_after_s=120.0)


class Replica:
    """A replica's cumulative step sums, as its reports carry them: mixed decode and prefill steps."""

    def __init__(self, seed: int, max_seqs: int = 16, min_seqs: int = 1):
        self.sums = StepSums()
        self.rng = random.Random(seed)
        self.seqs = (min_seqs, max_seqs)

    def run(self, steps: int, slowdown: float) -> None:
        for _ in range(steps):
            seqs = self.rng.randint(*self.seqs)
            tokens = seqs if self.rng.random() < 0.8 else self.rng.randint(64, 512)
            shape = StepShape(tokens, tokens * self.rng.randint(64, 1024), seqs, seqs)
            noise = self.rng.uniform(0.8, 1.25)  # bursty, but no fault
            self.sums.record(shape, linear_seconds(COST, shape.vector()) * slowdown * noise)

    def report(self) -> RoutingStats:
        return RoutingStats(step_gram=tuple(self.sums.gram), step_moments=tuple(self.sums.moments))


def _simulate(detector, replicas: dict[str, Replica], slowdown, seconds: float, start_s: float = 0.0,
              steps_per_s: int = 20, quarantined_steps: int = 0):
    """Report every second for ``seconds``; ``slowdown(replica_id, t)``. Returns the transitions and their times."""
    changes = []
    for tick in range(int(seconds)):
        now = start_s + tick + 1.0
        held = detector.quarantined()
        for replica_id, replica in replicas.items():
            # A quarantined replica runs only what its probes and its last streams give it.
            replica.run(quarantined_steps if replica_id in held else steps_per_s, slowdown(replica_id, now))
            detector.observe(replica_id, replica.report(), now)
        changes += detector.update(list(replicas), now)
    return changes


def test_a_replica_five_times_slower_is_quarantined_within_the_window_and_readmitted_once_it_recovers():
    detector = GrayFailureDetector(CONFIG)
    replicas = {name: Replica(i) for i, name in enumerate("ab")}
    fault = {"on": True}
    changes = _simulate(detector, replicas, lambda r, t: 5.0 if r == "b" and fault["on"] else 1.0, 30,
                        quarantined_steps=4)
    assert [(c.replica_id, c.kind) for c in changes] == [("b", "quarantined")]
    assert changes[0].at_s <= 20.0 and changes[0].slowness >= CONFIG.slow_factor
    assert detector.allowed(["a", "b"]) == ["a"] and detector.allowed(["b"]) == ["b"]
    fault["on"] = False
    changes = _simulate(detector, replicas, lambda r, t: 1.0, 40, start_s=30.0, quarantined_steps=4)
    assert [(c.replica_id, c.kind) for c in changes] == [("b", "readmitted")]
    assert detector.quarantined() == set() and detector.allowed(["a", "b"]) == ["a", "b"]


def test_a_slow_replica_given_smaller_batches_is_still_found():
    """A router that weighs decodes by speed sends the slow replica less; a law fitted over the whole pool
    would then blame the batch size, and the slow replica would look almost as fast as the others."""
    detector = GrayFailureDetector(CONFIG)
    replicas = {"a": Replica(0, min_seqs=8, max_seqs=16), "b": Replica(1, min_seqs=8, max_seqs=16),
                "slow": Replica(2, max_seqs=2)}
    changes = _simulate(detector, replicas, lambda r, t: 5.0 if r == "slow" else 1.0, 20)
    assert [(c.replica_id, c.kind) for c in changes] == [("slow", "quarantined")]
    assert 4.0 <= changes[0].slowness <= 6.0


def test_bursty_steps_without_a_fault_quarantine_nothing():
    detector = GrayFailureDetector(CONFIG)
    replicas = {name: Replica(i) for i, name in enumerate("abcd")}
    # Load swings (steps per second) and noise, but every replica is as fast as the others.
    changes = []
    for minute in range(10):
        changes += _simulate(detector, replicas, lambda r, t: 1.0, 60, start_s=60.0 * minute,
                             steps_per_s=5 if minute % 2 else 40)
    assert changes == [] and max(detector.slowness(r) for r in replicas) < 1.5


def test_the_last_healthy_replica_and_more_than_max_fraction_are_never_quarantined():
    detector = GrayFailureDetector(CONFIG)
    replicas = {name: Replica(i) for i, name in enumerate("abcd")}
    slow = {"b": 5.0, "c": 6.0, "d": 7.0}  # three of four slow: at most half may go
    changes = _simulate(detector, replicas, lambda r, t: slow.get(r, 1.0), 40, quarantined_steps=4)
    assert len({c.replica_id for c in changes if c.kind == "quarantined"}) <= 2
    assert "a" not in detector.quarantined()
    two = GrayFailureDetector(GrayFailureConfig(max_fraction=0.5))
    pair = {"a": Replica(0), "b": Replica(1)}
    _simulate(two, pair, lambda r, t: 5.0, 30)  # both equally slow: neither is slower than the other
    assert two.quarantined() == set()


def test_a_replica_quarantined_past_the_deadline_is_reported_for_replacement_once():
    detector = GrayFailureDetector(CONFIG)
    replicas = {name: Replica(i) for i, name in enumerate("ab")}
    changes = _simulate(detector, replicas, lambda r, t: 5.0 if r == "b" else 1.0, 200, quarantined_steps=4)
    kinds = [(c.replica_id, c.kind) for c in changes]
    assert kinds == [("b", "quarantined"), ("b", "replace")]
    assert changes[1].at_s - changes[0].at_s == pytest.approx(CONFIG.replace_after_s, abs=1.0)


def test_a_gone_replica_is_forgotten_and_bad_configs_are_refused():
    detector = GrayFailureDetector(CONFIG)
    replicas = {name: Replica(i) for i, name in enumerate("ab")}
    _simulate(detector, replicas, lambda r, t: 5.0 if r == "b" else 1.0, 30, quarantined_steps=4)
    assert detector.quarantined() == {"b"}
    detector.update(["a"], 31.0)
    assert detector.quarantined() == set()
    with pytest.raises(ValueError, match="readmit_factor"):
        GrayFailureConfig(slow_factor=1.2, readmit_factor=1.5)
    with pytest.raises(ValueError, match="max_fraction"):
        GrayFailureConfig(max_fraction=1.0)
