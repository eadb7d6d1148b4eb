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

Evidence is counted in steps or in computed tokens, whichever holds more: a
replica is judged once its decayed sums hold ``min_replica_steps`` steps *or*
``min_replica_tokens`` computed tokens. A decode replica runs many small
steps; a prefill replica runs one step per prompt, so at low load it would
never reach a step count, while one long prompt is plenty of evidence about
its speed in seconds per computed token.

A replica whose median slowness over ``window_s`` is ``slow_factor`` (3x) or
more is quarantined: routers stop giving it new requests (``allowed``), and the
ingress moves its decode streams (``pd.serve.generation``). The median is of
the window's judgments, one for each report that brought new steps while the
evidence sufficed; of an even count, the lower middle one (the higher for a
readmission), so that two judgments that disagree decide nothing. A verdict
needs judgments begun a whole window ago and at least ``MIN_REPORTS`` of them
in it. A report with too little evidence is a gap in the window, not its end;
only a replica measured nothing for ``stale_after_s`` is judged afresh.

The ingress measures replicas with small requests of its own every
``probe_interval_s`` (``pd.serve.probes``: never a user's request), chosen by
``probe_targets``: the quarantined, which nothing else would measure, and the
*suspects*, measured ``SUSPECT_FACTOR`` (2x) slower or more on whatever
evidence they had, quarantined or not. A suspect is often one the router has
stopped feeding because its queue drains slowly, which starves the detector
of the evidence that would confirm it; its probes confirm it or clear it.
A quarantined replica slower by no more than ``readmit_factor`` for
``window_s`` is readmitted. Quarantined past ``replace_after_s``, it is
reported for replacement once. A pool never quarantines its last healthy
replica, nor more than ``max_fraction`` of its replicas.

Pure Python, no Ray: the Serve routers and the simulator run it unmodified.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from router.protocol import RoutingStats
from router.step_cost import GRAM_SIZE, NUM_TERMS, fit_linear, gram_matrix

# A replica measured this much slower than its pool predicts, on any evidence, is probed until a probe
# confirms it (quarantined) or clears it (measured faster). Healthy replicas measured at most 1.4x under
# bursty load on two shared cores (docs/reliability.md).
SUSPECT_FACTOR = 2.0
# A reading on this share of the evidence a judgment needs makes a suspect, never a quarantine.
PROVISIONAL_SHARE = 0.25
# A verdict rests on at least this many reports of new steps in its window, so one stalled step is not one.
MIN_REPORTS = 2
# The fresh prompt a prefill probe computes (``pd.serve.probes``): twice ``min_replica_tokens`` at most, so
# that one probe is judged while its decayed tokens still suffice.
PREFILL_PROBE_TOKENS = 1024


@dataclass(frozen=True)
class GrayFailureConfig:
    slow_factor: float = 3.0
    readmit_factor: float = 1.5
    window_s: float = 10.0
    half_life_s: float = 3.0  # of the speed fit: a change shows within a few
    min_replica_steps: float = 16.0  # (decayed) steps before a replica's speed is judged ...
    min_replica_tokens: float = 512.0  # ... or computed tokens, whatever its steps (a prefill replica's evidence)
    probe_interval_s: float = 5.0
    replace_after_s: float = 300.0
    max_fraction: float = 0.5
    stale_after_s: float = 30.0  # a speed not measured for this long is not judged (an idle replica)

    def __post_init__(self) -> None:
        if not self.slow_factor > self.readmit_factor >= 1.0:
            raise ValueError(f"gray failure: need slow_factor > readmit_factor >= 1, got {self.slow_factor} "
                             f"and {self.readmit_factor}")
        for name in ("window_s", "half_life_s", "probe_interval_s", "replace_after_s", "stale_after_s",
                     "min_replica_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"gray failure: {name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.min_replica_tokens <= PREFILL_PROBE_TOKENS / 2:
            raise ValueError(f"gray failure: min_replica_tokens must be in (0, {PREFILL_PROBE_TOKENS // 2}] (half a "
                             f"prefill probe's {PREFILL_PROBE_TOKENS} tokens), got {self.min_replica_tokens}")
        if not 0.0 <= self.max_fraction < 1.0:
            raise ValueError(f"gray failure: max_fraction must be in [0, 1), got {self.max_fraction}")


def probe_targets(quarantined: Collection[str], slowness: Mapping[str, float]) -> list[str]:
    """The replicas the ingress probes: the quarantined, and the suspects (slowness ``SUSPECT_FACTOR`` or more)."""
    return sorted(set(quarantined) | {replica for replica, value in slowness.items() if value >= SUSPECT_FACTOR})


@dataclass(frozen=True)
class Transition:
    """A change the detector made: ``quarantined``, ``readmitted`` or ``replace`` (quarantined too long)."""

    replica_id: str
    kind: str
    slowness: float
    at_s: float


class Verdict(NamedTuple):
    """A window's median slowness, of an even count the lower middle one (``low``: what a quarantine needs) and
    the higher (``high``: what a readmission needs): two judgments that disagree decide nothing."""

    low: float
    high: float


class Reading(NamedTuple):
    """A replica's slowness now; ``confirmed`` when its evidence suffices to judge it (else it only makes a suspect)."""

    slowness: float
    confirmed: bool


@dataclass
class _State:
    # The judgments of the last window_s, one per report of new steps: (when, slowness); since when judgments
    # run (restarted by a change, and by a replica measured nothing for stale_after_s); the report last judged.
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    judged_since: float | None = None
    judged_report_s: float = -math.inf
    quarantined_at: float | None = None
    replace_reported: bool = False
    slowness: float = 1.0

    def restart(self) -> None:
        self.samples.clear()
        self.judged_since = None

    def judge(self, value: float | None, measured_s: float, now_s: float, window_s: float) -> Verdict | None:
        """The window's verdict now; None until judgments have run a whole window and ``MIN_REPORTS`` of its
        reports were judged. ``value`` None: too little evidence now, a gap in the window, not its end; a report
        already judged is not judged again (a replica fed nothing is not judged once a second on its old steps)."""
        if value is not None and measured_s > self.judged_report_s:
            self.samples.append((now_s, value))
            self.judged_report_s = measured_s
            self.judged_since = now_s if self.judged_since is None else self.judged_since
        while self.samples and self.samples[0][0] < now_s - window_s:
            self.samples.popleft()
        if self.judged_since is None or now_s - self.judged_since < window_s or len(self.samples) < MIN_REPORTS:
            return None
        values = [sample for _, sample in self.samples]
        return Verdict(statistics.median_low(values), statistics.median_high(values))


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
        """The replica's last reading, confirmed or not (1.0 before any)."""
        state = self._states.get(replica_id)
        return state.slowness if state is not None else 1.0

    def probe_targets(self) -> list[str]:
        """``probe_targets`` of this detector's pool: its quarantined replicas and its suspects."""
        return probe_targets(self.quarantined(), {r: state.slowness for r, state in self._states.items()})

    def evidence(self, gram: np.ndarray) -> float:
        """The share of a judgment's evidence that decayed step sums hold: their steps over ``min_replica_steps``
        or their computed tokens (the Gram triangle's first row: the features' totals) over
        ``min_replica_tokens``, whichever is more. 1 or more: enough."""
        return max(float(gram[0]) / self.config.min_replica_steps, float(gram[1]) / self.config.min_replica_tokens)

    def readings(self, replica_ids: Sequence[str], now_s: float) -> dict[str, Reading]:
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
            evidence = self.evidence(gram)
            if evidence < PROVISIONAL_SHARE or self.evidence(others_gram) < 1.0:
                continue
            law = fit_linear(gram_matrix(others_gram), total_moments - moments)
            predicted = float(np.dot(law, gram[:NUM_TERMS])) if law is not None else 0.0
            if predicted > 0:  # the triangle's first row: the replica's feature totals
                out[replica_id] = Reading(float(moments[0]) / predicted, evidence >= 1.0)
        return out

    def update(self, replica_ids: Iterable[str], now_s: float) -> list[Transition]:
        """Judge the pool's live replicas now; forget the gone ones. Returns what changed."""
        live = list(replica_ids)
        for gone in (set(self._states) | set(self._sums)) - set(live):
            self._states.pop(gone, None)
            self._sums.pop(gone, None)
        readings = self.readings(live, now_s)
        changes: list[Transition] = []
        for replica_id in live:
            state = self._states.setdefault(replica_id, _State())
            reading = readings.get(replica_id)
            measured_s = self.measured_s(replica_id)
            if state.quarantined_at is not None and measured_s <= state.quarantined_at:
                reading = None  # quarantined and not measured since (no probe yet): nothing new to judge
            if now_s - measured_s > self.config.stale_after_s:
                state.restart()  # idle (or never measured): judged afresh once it runs again
            state.slowness = reading.slowness if reading is not None else state.slowness
            confirmed = reading.slowness if reading is not None and reading.confirmed else None
            verdict = state.judge(confirmed, measured_s, now_s, self.config.window_s)
            if state.quarantined_at is None:
                changes += self._judge_healthy(replica_id, state, verdict, live, now_s)
            else:
                changes += self._judge_quarantined(replica_id, state, verdict, now_s)
        return changes

    def _may_quarantine(self, live: Sequence[str]) -> bool:
        held = len(self.quarantined() & set(live))
        return len(live) - held >= 2 and held + 1 <= math.floor(self.config.max_fraction * len(live))

    def _judge_healthy(self, replica_id: str, state: _State, verdict: Verdict | None, live: Sequence[str],
                       now_s: float) -> list[Transition]:
        if verdict is None or verdict.low < self.config.slow_factor or not self._may_quarantine(live):
            return []
        state.quarantined_at = now_s
        state.restart()
        return [Transition(replica_id, "quarantined", verdict.low, now_s)]

    def _judge_quarantined(self, replica_id: str, state: _State, verdict: Verdict | None,
                           now_s: float) -> list[Transition]:
        if verdict is not None and verdict.high <= self.config.readmit_factor:
            self._states[replica_id] = _State(slowness=verdict.high)
            return [Transition(replica_id, "readmitted", verdict.high, now_s)]
        if not state.replace_reported and now_s - (state.quarantined_at or now_s) >= self.config.replace_after_s:
            state.replace_reported = True
            return [Transition(replica_id, "replace", state.slowness, now_s)]
        return []

    def allowed(self, replica_ids: Sequence[str]) -> list[str]:
        """The replicas a new request may go to: all but the quarantined (all, if every one of them is)."""
        held = self.quarantined()
        healthy = [r for r in replica_ids if r not in held]
        return healthy or list(replica_ids)
