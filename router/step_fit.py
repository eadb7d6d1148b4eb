"""Online fits from the replicas' reports: the step cost model's coefficients, each replica's speed, transfers.

Every replica's ``RoutingStats`` carries cumulative sums: its steps'
(``router.step_cost.StepSums``) and its KV pulls'. A reader differences each
report against the replica's last and decays the growth by half every
``half_life_s`` of report time, so a fit follows a change within a few
half-lives:

- ``StepCostFit``: the pool's coefficients, least squares over every
  replica's recent steps, and each replica's speed, its recent measured
  seconds over what the pool's fit says its own steps should have taken;
- ``TransferFit``: seconds per KV block pulled, over the decode replicas'
  recent pulls.

A replica whose sums went back (a new process) starts afresh. Pure Python
and numpy, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from router.protocol import RoutingStats
from router.step_cost import GRAM_SIZE, NUM_TERMS, fit_linear, gram_matrix


@dataclass
class _Speed:
    """One replica's decayed step totals: the features' sums (a Gram matrix's first row) and seconds."""

    totals: np.ndarray = field(default_factory=lambda: np.zeros(NUM_TERMS))
    seconds: float = 0.0
    at_s: float = 0.0  # when they were last decayed
    measured_s: float = -math.inf  # when a report last brought steps


class StepCostFit:
    """The pool's step cost and each replica's speed, fitted online from the replicas' cumulative step sums."""

    def __init__(self, half_life_s: float, min_steps: float, min_replica_steps: float,
                 prior: Sequence[float] | None = None) -> None:
        self.half_life_s = half_life_s
        self.min_steps = min_steps
        self.min_replica_steps = min_replica_steps
        self.prior = None if prior is None else tuple(float(value) for value in prior)
        self._gram = np.zeros(GRAM_SIZE)  # decayed, as the upper triangle the reports carry (gram_matrix)
        self._moments = np.zeros(NUM_TERMS)
        self._at_s = 0.0
        self._last: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # each replica's cumulative sums, as last seen
        self._speeds: dict[str, _Speed] = {}
        self._coefficients: tuple[float, ...] | None = self.prior
        self._dirty = False
        self._speed_cache: dict[str, float] = {}  # each replica's speed under the current fit
        self._fastest: float | None = None

    def _decay(self, elapsed_s: float) -> float:
        return 0.5 ** (max(0.0, elapsed_s) / self.half_life_s)

    def observe(self, replica_id: str, stats: RoutingStats, now_s: float) -> None:
        """A replica's report: the steps it ran since its last one join the fit."""
        if not stats.step_gram:
            return
        gram, moments = np.array(stats.step_gram), np.array(stats.step_moments)
        last = self._last.get(replica_id)
        self._last[replica_id] = (gram, moments)
        if last is not None and gram[0] >= last[0][0]:
            gram, moments = gram - last[0], moments - last[1]
        elif last is not None:  # the replica restarted and its sums began again: a new process, a new speed
            self._speeds.pop(replica_id, None)
            self._speed_cache.pop(replica_id, None)
            self._fastest = None
        if gram[0] <= 0:
            return
        decay = self._decay(now_s - self._at_s)
        self._gram = self._gram * decay + gram
        self._moments = self._moments * decay + moments
        self._at_s = now_s
        self._dirty = True
        self._speed_cache.clear()
        self._fastest = None
        speed = self._speeds.setdefault(replica_id, _Speed(at_s=now_s))
        decay = self._decay(now_s - speed.at_s)
        speed.totals = speed.totals * decay + gram[:NUM_TERMS]  # the triangle's first row: the features' totals
        speed.seconds = speed.seconds * decay + float(moments[0])  # a Python float: it reaches every prediction
        speed.at_s = speed.measured_s = now_s

    def coefficients(self) -> tuple[float, ...] | None:
        """The pool's step cost (base, per token, per pair, per seq, per sample); the prior, or None, before data.

        Refitted at most once per batch of reports (a few microseconds of numpy), not per decision.
        """
        if self._dirty:
            self._dirty = False
            fitted = fit_linear(gram_matrix(self._gram), self._moments) if self._gram[0] >= self.min_steps else None
            self._coefficients = tuple(float(value) for value in fitted) if fitted is not None else self.prior
        return self._coefficients

    def speed(self, replica_id: str) -> float:
        """The replica's measured seconds over the pool fit's, recently; 1.0 until it ran enough steps."""
        cached = self._speed_cache.get(replica_id)
        if cached is not None and not self._dirty:
            return cached
        speed, coefficients = self._speeds.get(replica_id), self.coefficients()
        value = 1.0
        if speed is not None and coefficients is not None and speed.totals[0] >= self.min_replica_steps:
            predicted = float(np.dot(coefficients, speed.totals))
            value = speed.seconds / predicted if predicted > 0 else 1.0
        self._speed_cache[replica_id] = value
        return value

    def fastest(self) -> float:
        """The least speed of any replica measured (1.0 before any): the pool's fastest."""
        if self._fastest is None or self._dirty:
            self._fastest = min((self.speed(replica_id) for replica_id in self._speeds), default=1.0) or 1.0
        return self._fastest

    def measured_s(self, replica_id: str) -> float:
        """When the replica's last report brought steps (-inf: never)."""
        speed = self._speeds.get(replica_id)
        return speed.measured_s if speed is not None else -math.inf

    def forget(self, replica_id: str) -> None:
        self._last.pop(replica_id, None)
        self._speeds.pop(replica_id, None)
        self._speed_cache.pop(replica_id, None)
        self._fastest = None



class TransferFit:
    """Seconds per KV block pulled, from the decode replicas' cumulative pulls, decayed as the step sums are."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._last: dict[str, tuple[int, float]] = {}
        self._blocks = self._seconds = self._at_s = 0.0

    def observe(self, replica_id: str, stats: RoutingStats, now_s: float) -> None:
        blocks, seconds = stats.num_pulled_blocks, stats.pull_seconds_total
        last_blocks, last_seconds = self._last.get(replica_id, (0, 0.0))
        self._last[replica_id] = (blocks, seconds)
        if blocks >= last_blocks:
            blocks, seconds = blocks - last_blocks, seconds - last_seconds
        if blocks <= 0:
            return
        decay = 0.5 ** (max(0.0, now_s - self._at_s) / self.half_life_s)
        self._blocks = self._blocks * decay + blocks
        self._seconds = self._seconds * decay + max(0.0, seconds)
        self._at_s = now_s

    def seconds(self, num_blocks: int) -> float | None:
        """A pull of ``num_blocks`` blocks; None before any pull was reported."""
        return num_blocks * self._seconds / self._blocks if self._blocks > 0 else None

    def forget(self, replica_id: str) -> None:
        self._last.pop(replica_id, None)
