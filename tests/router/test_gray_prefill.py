"""The gray-failure detector on a prefill pool (``router.gray``): evidence in computed tokens, suspects.

A prefill replica runs one step per prompt, so at low load it never holds
``min_replica_steps`` steps within the half-life; one long prompt is plenty of
evidence of its seconds per computed token. The clock is the tests' own: one
report and one judgment a second, as the app's routers make them.
"""

from __future__ import annotations

import itertools

import pytest

from router.gray import (
    PREFILL_PROBE_TOKENS,
    SUSPECT_FACTOR,
    GrayFailureConfig,
    GrayFailureDetector,
    Transition,
    probe_targets,
)
from router.protocol import RoutingStats
from router.step_cost import StepShape, StepSums, linear_seconds, prefill_pairs

COST = (2e-3, 4e-5, 2e-9, 1e-4, 2e-4)  # base, per token, per pair, per seq, per sample
CONFIG = GrayFailureConfig()  # the defaults: 16 steps or 512 tokens, a 10 s window, a 3 s half-life


class PrefillReplica:
    """A prefill replica's cumulative step sums: each prompt computed alone, in ``num_steps`` chunks."""

    def __init__(self, slowdown: float = 1.0):
        self.sums = StepSums()
        self.slowdown = slowdown

    def prefill(self, num_tokens: int, num_steps: int = 1) -> None:
        computed = 0
        for step in range(num_steps):
            chunk = num_tokens * (step + 1) // num_steps - computed
            shape = StepShape(chunk, prefill_pairs(chunk, computed), 1, 1 if step == num_steps - 1 else 0)
            self.sums.record(shape, linear_seconds(COST, shape.vector()) * self.slowdown)
            computed += chunk

    def report(self) -> RoutingStats:
        return RoutingStats(step_gram=tuple(self.sums.gram), step_moments=tuple(self.sums.moments))


def tick(detector: GrayFailureDetector, replicas: dict[str, PrefillReplica], now_s: float) -> list[Transition]:
    """Every replica reports, then the pool is judged."""
    for replica_id, replica in replicas.items():
        detector.observe(replica_id, replica.report(), now_s)
    return detector.update(list(replicas), now_s)


def run(detector, replicas, seconds: int, prompts, start_s: int = 0) -> list[Transition]:
    """``prompts(replica_id, t)``: the prompt lengths that replica computes in second ``t``."""
    changes = []
    for t in range(start_s + 1, start_s + seconds + 1):
        for replica_id, replica in replicas.items():
            for num_tokens in prompts(replica_id, t):
                replica.prefill(num_tokens)
        changes += tick(detector, replicas, float(t))
    return changes


def alternating(num_tokens: int, every_s: int):
    """Each of ``a`` and ``b`` gets one prompt of ``num_tokens`` every ``every_s`` seconds, in turn."""
    return lambda replica_id, t: [num_tokens] if t % every_s == (0 if replica_id == "a" else every_s // 2) else []


def test_one_prompt_of_a_slow_prefill_replica_every_two_seconds_is_judged_on_its_tokens():
    """Half a prompt a second each: 2.7 decayed steps (never the 16 a judgment needed), 2,700 tokens."""
    detector = GrayFailureDetector(CONFIG)
    replicas = {"a": PrefillReplica(), "b": PrefillReplica(slowdown=5.0)}
    changes = run(detector, replicas, 30, alternating(1000, 2))
    assert [(c.replica_id, c.kind, c.at_s) for c in changes] == [("b", "quarantined", 12.0)]  # judged from t=2 on
    assert changes[0].slowness == pytest.approx(5.0, rel=1e-6)  # the other's law predicts the same steps exactly
    assert detector.slowness("a") == pytest.approx(0.2, rel=1e-6)  # against b's law, in a pool of two


def test_the_step_count_does_not_matter_only_the_computed_tokens():
    """The same prompts chunked into 4 steps each: the same verdict at the same time."""
    verdicts = []
    for num_steps in (1, 4):
        detector = GrayFailureDetector(CONFIG)
        replicas = {"a": PrefillReplica(), "b": PrefillReplica(slowdown=5.0)}
        changes = []
        for t in range(1, 31):
            replicas["a" if t % 2 == 0 else "b"].prefill(1000, num_steps)
            changes += tick(detector, replicas, float(t))
        verdicts.append([(c.replica_id, c.kind, c.at_s, round(c.slowness, 6)) for c in changes])
    assert verdicts[0] == verdicts[1] == [("b", "quarantined", 12.0, 5.0)]


def test_evidence_is_steps_or_computed_tokens_whichever_holds_more():
    detector = GrayFailureDetector(CONFIG)
    decode = StepSums()
    for _ in range(8):  # 8 decode steps of 4 sequences: half the steps a judgment needs, 32 tokens
        decode.record(StepShape(4, 4 * 300, 4, 4), 0.01)
    prefill = StepSums()
    prefill.record(StepShape(256, prefill_pairs(256, 0), 1, 1), 0.05)  # one step, half the tokens
    assert detector.evidence(decode.gram) == pytest.approx(8 / 16)
    assert detector.evidence(prefill.gram) == pytest.approx(256 / 512)


def test_a_slow_replica_on_short_prompts_is_a_suspect_not_quarantined():
    """100-token prompts every 2 s: 270 decayed tokens at most, over a quarter of a judgment's evidence but
    under all of it. Its reading makes it a suspect for the ingress to probe; no verdict rests on it."""
    detector = GrayFailureDetector(CONFIG)
    replicas = {"a": PrefillReplica(), "b": PrefillReplica(slowdown=5.0)}
    lengths = itertools.cycle((200, 600, 1000))  # three lengths: the other's law is exact for any length

    def prompts(replica_id: str, t: int) -> list[int]:
        if replica_id == "a":
            return [next(lengths)]
        return [100] if t % 2 == 1 else []

    changes = run(detector, replicas, 60, prompts)
    assert changes == []
    assert detector.slowness("b") == pytest.approx(5.0, rel=1e-6)
    assert detector.probe_targets() == ["b"]


def test_a_verdict_survives_gaps_in_the_evidence():
    """One prompt every 6 s: under 512 decayed tokens for a second or two before each. A gap skips, it does
    not restart the window (it did, and such a replica was never judged)."""
    detector = GrayFailureDetector(CONFIG)
    replicas = {"a": PrefillReplica(), "b": PrefillReplica(slowdown=5.0)}
    changes = run(detector, replicas, 40, lambda r, t: [1000] if r == "a" or t % 6 == 1 else [])
    assert [(c.replica_id, c.kind) for c in changes] == [("b", "quarantined")]
    assert changes[0].at_s == 11.0  # judged from its first prompt at t=1, a whole window on
    assert changes[0].slowness == pytest.approx(5.0, rel=1e-6)


def test_one_stalled_prompt_is_no_verdict_and_a_replica_idle_past_stale_after_s_is_judged_afresh():
    detector = GrayFailureDetector(CONFIG)
    replicas = {"a": PrefillReplica(), "b": PrefillReplica()}
    stalled = {"t": 12}

    def prompts(replica_id: str, t: int) -> list[int]:
        replicas["b"].slowdown = 5.0 if replica_id == "b" and t == stalled["t"] else 1.0
        return [1000] if replica_id == "a" or t % 2 == 1 or t == stalled["t"] else []

    changes = run(detector, replicas, 40, prompts)
    assert changes == [] and detector.slowness("b") < 1.5 and detector.probe_targets() == []
    # b stops (a still works): its last reading stays, then past stale_after_s it is no longer judged.
    changes = run(detector, replicas, 40, lambda r, t: [1000] if r == "a" else [], start_s=40)
    assert changes == [] and detector._states["b"].judged_since is None


def test_probe_targets_are_the_quarantined_and_the_suspects():
    slowness = {"a": 1.0, "b": SUSPECT_FACTOR, "c": SUSPECT_FACTOR - 0.01, "d": 7.5}
    assert probe_targets(set(), slowness) == ["b", "d"]
    assert probe_targets({"c"}, slowness) == ["b", "c", "d"]
    assert probe_targets({"e"}, {}) == ["e"]  # quarantined, never read since it restarted


def test_min_replica_tokens_must_leave_one_probe_enough_evidence():
    assert GrayFailureConfig(min_replica_tokens=PREFILL_PROBE_TOKENS / 2).min_replica_tokens == 512
    for bad in (0.0, PREFILL_PROBE_TOKENS / 2 + 1):
        with pytest.raises(ValueError, match="min_replica_tokens"):
            GrayFailureConfig(min_replica_tokens=bad)
    with pytest.raises(ValueError, match="min_replica_steps"):
        GrayFailureConfig(min_replica_steps=0.0)


def test_one_stalled_prompt_after_a_quiet_spell_makes_a_suspect_that_a_probe_clears():
    """b runs three prompts, then nothing for 15 s, then one prompt stalled 5x: the only report in its window.
    No verdict rests on one report; b is a suspect, and the ingress's probe 5 s on (a fresh prompt of
    ``PREFILL_PROBE_TOKENS``) measures it fast: 1.9x with the stall's decayed steps, then nothing slow."""
    detector = GrayFailureDetector(CONFIG)
    replicas = {"a": PrefillReplica(), "b": PrefillReplica()}
    changes = run(detector, replicas, 20, lambda r, t: [1000] if r == "a" or t in (1, 3, 5) else [])
    replicas["b"].slowdown = 5.0
    changes += run(detector, replicas, 1, lambda r, t: [1000], start_s=20)
    replicas["b"].slowdown = 1.0
    changes += run(detector, replicas, 4, lambda r, t: [1000] if r == "a" else [], start_s=21)
    assert changes == [] and detector.probe_targets() == ["b"]
    changes += run(detector, replicas, 1, lambda r, t: [1000] if r == "a" else [PREFILL_PROBE_TOKENS], start_s=25)
    assert detector.slowness("b") == pytest.approx(1.9, abs=0.05) and detector.probe_targets() == []
    changes += run(detector, replicas, 30, lambda r, t: [1000] if r == "a" or t % 5 == 0 else [], start_s=26)
    assert changes == [] and detector.probe_targets() == []
