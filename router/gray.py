"""Gray failures: a replica that is alive but persistently slow is quarantined, probed, and readmitted.

Health checks pass a replica that a noisy neighbour, a throttled CPU or a
degraded NIC has made slow, and a router that only counts load keeps feeding
it. The detector reads what every replica already reports, its steps' shapes
and seconds (``RoutingStats``'s cumulative step sums), decayed over a short
half-life. A replica's *slowness* is its steps' measured seconds over what
the step cost law (``router.step_cost``) fitted to the *other* replicas'
steps predicts for the same steps: a replica running larger batches is not
called slow for it, and a slow one does not drag the law it is judged by (a
router that sends the slow replica smaller batches would otherwise hide it).

A replica whose median slowness over ``window_s`` is ``slow_factor`` (3x) or
more is quarantined: routers stop giving it new requests (``allowed``), and the
ingress moves its decode streams (``pd.serve.generation``). The ingress
measures it with a small request of its own every ``probe_interval_s``
(``pd.serve.probes``: never a user's request); slower by no more than
``readmit_factor`` for ``window_s`` on end, it is readmitted. Quarantined past ``replace_after_s``, it is reported for
replacement once. A pool never quarantines its last healthy replica, nor
more than ``max_fraction`` of its replicas.

Pure Python, no Ray: the Serve routers and the simulator run it unmodified.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from router.protocol import RoutingStats
from router.step_cost import GRAM_SIZE, NUM_TERMS, fit_linear, gram_matrix


@dataclass(frozen=True)
class GrayFailureConfig:
    slow_factor: float = 3.0
    readmit_factor: float = 1.5
    window_s: float = 10.0
    half_life_s: float = 3.0  # of the speed fit: a change shows within a few
    min_replica_steps: float = 16.0  # (decayed) steps before a replica's speed is judged
    probe_interval_s: float = 5.0
    replace_after_s: float = 300.0
    max_fraction: float = 0.5
    stale_after_s: float = 30.0  # a speed not measured for this long is not judged (an idle replica)

    def __post_init__(self) -> None:
        if not self.slow_factor > self.readmit_factor >= 1.0:
            raise ValueError(f"gray failure: need slow_factor > readmit_factor >= 1, got {self.slow_factor} "
                             f"and {self.readmit_factor}")
        for name in ("window_s", "half_life_s", "probe_interval_s", "replace_after_s", "stale_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"gray failure: {name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.max_fraction < 1.0:
            raise ValueError(f"gray failure: max_fraction must be in [0, 1), got {self.max_fraction}")


@dataclass(frozen=True)
class Transition:
    """A change the detector made: ``quarantined``, ``readmitted`` or ``replace`` (quarantined too long)."""

    replica_id: str
    kind: str
    slowness: float
    at_s: float


@dataclass
class _State:
    # The slowness judged over the last window_s, and since when judgments run unbroken (reset by a change,
    # and by a judgment with no fresh measurement).
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    judged_since: float | None = None
    quarantined_at: float | None = None
    replace_reported: bool = False
    slowness: float = 1.0

    def judge(self, value: float | None, now_s: float, window_s: float) -> float | None:
        """The median slowness over a whole window ending now; None until one is covered."""
        if value is None:
            self.samples.clear()
            self.judged_since = None
            return None
        self.samples.append((now_s, value))
        while self.samples[0][0] < now_s - window_s:
            self.samples.popleft()
        self.judged_since = now_s if self.judged_since is None else self.judged_since
        if now_s - self.judged_since < window_s:
            return None
        return statistics.median(sample for _, sample in self.samples)


@dataclass
class _Sums:
    """One replica's decayed step sums (a Gram triangle and moments, as reports carry them cumulatively)."""

    gram: np.ndarray = field(default_factory=lambda: np.zeros(GRAM_SIZE))
    moments: np.ndarray = field(default_factory=lambda: np.zeros(NUM_TERMS))
    at_s: float = 0.0
    measured_s: float = -math.inf  # when a report last brought steps
    last: tuple[np.ndarray, np.ndarray] | None = None  # the cumulative sums last reported

    def decayed(self, now_s: float, half_life_s: float) -> tuple[np.ndarray, np.ndarray]:
        decay = 0.5 ** (max(0.0, now_s - self.at_s) / half_life_s)
        return self.gram * decay, self.moments * decay


@dataclass
class GrayFailureDetector:
    """Each replica's slowness against its pool's, and the quarantine it implies."""

    config: GrayFailureConfig = field(default_factory=GrayFailureConfig)

    def __post_init__(self) -> None:
        self._sums: dict[str, _Sums] = {}
        self._states: dict[str, _State] = {}

    def observe(self, replica_id: str, stats: RoutingStats, now_s: float) -> None:
        """A replica's report: the steps it ran since its last one join its decayed sums."""
        if not stats.step_gram:
            return
        gram, moments = np.array(stats.step_gram), np.array(stats.step_moments)
        sums = self._sums.setdefault(replica_id, _Sums(at_s=now_s))
        last, sums.last = sums.last, (gram, moments)
        if last is not None and gram[0] >= last[0][0]:
            gram, moments = gram - last[0], moments - last[1]
        elif last is not None:  # its sums began again: a new process, judged afresh
            sums.gram, sums.moments = np.zeros(GRAM_SIZE), np.zeros(NUM_TERMS)
        if gram[0] <= 0:
            return
        decayed = sums.decayed(now_s, self.config.half_life_s)
        sums.gram, sums.moments = decayed[0] + gram, decayed[1] + moments
        sums.at_s = sums.measured_s = now_s

    def measured_s(self, replica_id: str) -> float:
        sums = self._sums.get(replica_id)
        return sums.measured_s if sums is not None else -math.inf

    def quarantined(self) -> set[str]:
        return {replica_id for replica_id, state in self._states.items() if state.quarantined_at is not None}

    def slowness(self, replica_id: str) -> float:
        state = self._states.get(replica_id)
        return state.slowness if state is not None else 1.0

    def _slowness(self, replica_ids: Sequence[str], now_s: float) -> dict[str, float]:
        """Each freshly measured replica's seconds over what the others' fitted law predicts for its steps."""
        fresh = {r: self._sums[r].decayed(now_s, self.config.half_life_s) for r in replica_ids
                 if r in self._sums and now_s - self._sums[r].measured_s <= self.config.stale_after_s}
        if len(fresh) < 2:
            return {}
        total_gram = sum(gram for gram, _ in fresh.values())
        total_moments = sum(moments for _, moments in fresh.values())
        out = {}
        for replica_id, (gram, moments) in fresh.items():
            others_gram = total_gram - gram
            if gram[0] < self.config.min_replica_steps or others_gram[0] < self.config.min_replica_steps:
                continue
            law = fit_linear(gram_matrix(others_gram), total_moments - moments)
            predicted = float(np.dot(law, gram[:NUM_TERMS])) if law is not None else 0.0
            if predicted > 0:  # the triangle's first row: the replica's feature totals
                out[replica_id] = float(moments[0]) / predicted
        return out

    def update(self, replica_ids: Iterable[str], now_s: float) -> list[Transition]:
        """Judge the pool's live replicas now; forget the gone ones. Returns what changed."""
        live = list(replica_ids)
        for gone in (set(self._states) | set(self._sums)) - set(live):
            self._states.pop(gone, None)
            self._sums.pop(gone, None)
        slowness = self._slowness(live, now_s)
        changes: list[Transition] = []
        for replica_id in live:
            state = self._states.setdefault(replica_id, _State())
            value = slowness.get(replica_id)
            if state.quarantined_at is not None and self.measured_s(replica_id) <= state.quarantined_at:
                value = None  # quarantined and not measured since (no probe yet): nothing new to judge
            state.slowness = value if value is not None else state.slowness
            over_window = state.judge(value, now_s, self.config.window_s)
            if state.quarantined_at is None:
                changes += self._judge_healthy(replica_id, state, over_window, live, now_s)
            else:
                changes += self._judge_quarantined(replica_id, state, over_window, now_s)
        return changes

    def _may_quarantine(self, live: Sequence[str]) -> bool:
        held = len(self.quarantined() & set(live))
        return len(live) - held >= 2 and held + 1 <= math.floor(self.config.max_fraction * len(live))

    def _judge_healthy(self, replica_id: str, state: _State, value: float | None, live: Sequence[str],
                       now_s: float) -> list[Transition]:
        """``value``: the median slowness over a whole window, or None."""
        if value is None or value < self.config.slow_factor or not self._may_quarantine(live):
            return []
        state.quarantined_at = now_s
        state.samples.clear()
        state.judged_since = None
        return [Transition(replica_id, "quarantined", value, now_s)]

    def _judge_quarantined(self, replica_id: str, state: _State, value: float | None,
                           now_s: float) -> list[Transition]:
        if value is not None and value <= self.config.readmit_factor:
            self._states[replica_id] = _State(slowness=value)
            return [Transition(replica_id, "readmitted", value, now_s)]
        if not state.replace_reported and now_s - (state.quarantined_at or now_s) >= self.config.replace_after_s:
            state.replace_reported = True
            return [Transition(replica_id, "replace", state.slowness, now_s)]
        return []

    def allowed(self, replica_ids: Sequence[str]) -> list[str]:
        """The replicas a new request may go to: all but the quarantined (all, if every one of them is)."""
        held = self.quarantined()
        healthy = [r for r in replica_ids if r not in held]
        return healthy or list(replica_ids)
