"""The SLO planner: how many prefill and decode replicas the next period needs. Pure Python, no Ray.

Each metrics period the replicas report what they saw (``ReplicaSignals``),
and ``plan`` turns the reports, the SLOs and the state it returned last time
into desired replica counts. It runs unchanged in the simulator and inside
Ray Serve's autoscaling policy.

Prefill is sized on prompt tokens arriving. One replica computes
``capacity.prefill_tokens_per_s`` (``C``); with ``n`` replicas sharing a
forecast demand ``D``, each is busy ``rho = D / (n * C)``, and a request's
TTFT is its own compute time stretched by the queue in front of it:

    ttft(n) = correction * (mean_prompt / C) / (1 - rho)          (an M/M/1 queue per replica)

The planner takes the smallest ``n`` with ``ttft(n) <= slo.ttft_s``, where
``D`` also carries the queued backlog drained over ``backlog_drain_s``:
requests already waiting need capacity too, not only those to come. Where a
prompt's own compute (``rho = 0``) already exceeds the SLO, no ``n`` meets
it; the planner then keeps each replica half busy rather than going to the
maximum (``prefill_slo_met`` in its figures says which it did).

Decode is sized on sequences in flight. A decode step of ``b`` sequences
takes ``correction * (decode_step_s + decode_step_per_seq_s * b)``; one
replica runs as many as keep that within the ITL SLO, fewer if their KV
would not fit (its blocks over the blocks a sequence holds now), and the
planner plans for ``decode_utilization`` of that.

``correction`` is observed over predicted latency (the worst replica's TTFT
p90 for prefill, ITL p90 for decode), smoothed, as Dynamo's planner corrects
its profile. It also maps the model's mean onto the tail the SLO is set on.
It learns only while the pool keeps up (no backlog beyond what the SLO
allows): latency from a backlog is the backlog's, not a wrong profile's.

The forecast is Holt's linear smoothing (level plus trend) of each demand,
looked ``forecast_periods`` ahead (replicas take a while to start), and never
below what was just observed. Scale-up takes effect at once; scale-down only
after every plan for ``scale_down_delay_s`` wanted fewer replicas, to the
most any of them wanted, and only to a count that would carry the demand with
``hysteresis`` to spare. Both stay within each pool's bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

# How far a correction may move the profile's capacity, either way.
_MAX_CORRECTION = 4.0
# How busy a prefill replica may be where its TTFT SLO cannot be met at any count.
_UNMET_SLO_UTILIZATION = 0.5


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"SLO targets must be > 0, got ttft_s={self.ttft_s}, itl_s={self.itl_s}")


@dataclass(frozen=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 1

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")

    def clamp(self, count: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, count))


@dataclass(frozen=True)
class Capacity:
    """What one replica sustains, from a profile (``sim.autoscale.capacity``) or measured."""

    prefill_tokens_per_s: float  # uncached prompt tokens one prefill replica computes per second
    decode_step_s: float  # one decode step's fixed time
    decode_step_per_seq_s: float  # and its time per sequence in the batch (at a typical context)

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_step_s < 0 or self.decode_step_per_seq_s <= 0:
            raise ValueError(f"capacities must be > 0, got {self}")

    def decode_itl_s(self, num_seqs: float) -> float:
        return self.decode_step_s + self.decode_step_per_seq_s * num_seqs

    def decode_seqs(self, itl_s: float) -> float:
        """Sequences one decode replica runs at once with steps within ``itl_s`` (0 if none fit)."""
        return max(0.0, (itl_s - self.decode_step_s) / self.decode_step_per_seq_s)


@dataclass(frozen=True)
class PlannerConfig:
    slo: Slo
    capacity: Capacity
    prefill: Bounds = Bounds()
    decode: Bounds = Bounds()
    period_s: float = 10.0  # between plans: the replicas' metrics period
    scale_down_delay_s: float = 60.0
    hysteresis: float = 0.2  # scale down only to a fleet that would carry this much more demand
    decode_utilization: float = 0.8  # of a decode replica's sequences to plan for
    forecast_periods: float = 2.0
    backlog_drain_s: float = 10.0  # queued prefill is planned to drain within this
    smoothing: float = 0.5  # Holt's level weight; the trend's too
    correction_smoothing: float = 0.3

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.backlog_drain_s <= 0:
            raise ValueError(f"period_s and backlog_drain_s must be > 0, got {self.period_s}, {self.backlog_drain_s}")
        if self.scale_down_delay_s < 0 or self.forecast_periods < 0:
            raise ValueError("scale_down_delay_s and forecast_periods must be >= 0")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        for name in ("decode_utilization", "smoothing", "correction_smoothing"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class ReplicaSignals:
    """One replica's report for the last period; None where it has nothing to say."""

    prefill_tokens: int = 0  # uncached prompt tokens it computed
    queued_prefill_tokens: int = 0  # waiting to be computed at the period's end
    num_requests: int = 0  # requests it finished prefilling
    running_seqs: int = 0  # sequences decoding at the period's end (holding KV)
    waiting_seqs: int = 0  # and waiting to
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None


@dataclass(frozen=True)
class _Holt:
    level: float | None = None
    trend: float = 0.0

    def update(self, value: float, weight: float) -> _Holt:
        if self.level is None:
            return _Holt(value, 0.0)
        level = weight * value + (1 - weight) * (self.level + self.trend)
        return _Holt(level, weight * (level - self.level) + (1 - weight) * self.trend)

    def ahead(self, periods: float) -> float:
        return max(0.0, (self.level or 0.0) + self.trend * periods)


@dataclass(frozen=True)
class PlannerState:
    """What ``plan`` remembers between periods; start from ``PlannerState()``."""

    prefill_demand: _Holt = _Holt()  # prompt tokens/s arriving
    decode_demand: _Holt = _Holt()  # sequences in flight
    prompt_tokens: _Holt = _Holt()  # per request
    queued_prefill_tokens: int | None = None
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    # Per pool, (time, wanted) of the plans since it last wanted as many as it has, oldest first.
    prefill_wants: tuple[tuple[float, int], ...] = ()
    decode_wants: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class Plan:
    num_prefill: int
    num_decode: int
    why: dict = field(default_factory=dict)  # the figures it planned from, for logs and metrics


def _sum(signals: Sequence[ReplicaSignals], name: str) -> int:
    return sum(getattr(s, name) for s in signals)


def _worst(signals: Sequence[ReplicaSignals], name: str) -> float | None:
    values = [getattr(s, name) for s in signals if getattr(s, name) is not None]
    return max(values) if values else None


def _corrected(previous: float, observed: float | None, predicted: float, weight: float) -> float:
    """The correction moved towards ``observed / predicted``; unchanged when either is unknown."""
    if observed is None or not 0 < predicted < math.inf:
        return previous
    ratio = min(_MAX_CORRECTION, max(1 / _MAX_CORRECTION, observed / predicted))
    return previous + weight * (ratio - previous)


def prefill_ttft_s(num_replicas: int, demand_tokens_per_s: float, prompt_tokens: float,
                   capacity_tokens_per_s: float) -> float:
    """The modelled mean TTFT of ``num_replicas`` sharing the demand; infinite when they cannot keep up."""
    utilization = demand_tokens_per_s / (num_replicas * capacity_tokens_per_s)
    if utilization >= 1:
        return math.inf
    return prompt_tokens / capacity_tokens_per_s / (1 - utilization)


def prefill_ttft_target_s(config: PlannerConfig, prompt_tokens: float, correction: float) -> float:
    """The TTFT to size prefill for: the SLO, or twice a prompt's own compute time where that exceeds it.

    More replicas shorten only the queue, never a prompt's own compute: an
    SLO below that cannot be met at any count, and the pool is sized to keep
    each replica half busy (its queue doubling TTFT at most) instead of
    going to its maximum, idle or not.
    """
    alone_s = correction * prefill_ttft_s(1, 0.0, prompt_tokens, config.capacity.prefill_tokens_per_s)
    return config.slo.ttft_s if alone_s < config.slo.ttft_s else alone_s / (1 - _UNMET_SLO_UTILIZATION)


def _fewest_prefill(config: PlannerConfig, demand: float, prompt_tokens: float, correction: float) -> int:
    capacity = config.capacity.prefill_tokens_per_s
    target_s = prefill_ttft_target_s(config, prompt_tokens, correction)
    for count in range(1, config.prefill.max_replicas + 1):
        if correction * prefill_ttft_s(count, demand, prompt_tokens, capacity) <= target_s * (1 + 1e-9):
            return count
    return config.prefill.max_replicas


def _settle(bounds: Bounds, current: int, wanted: int, wants: tuple, now_s: float,
            delay_s: float) -> tuple[int, tuple]:
    """Up at once; down to the most wanted over ``delay_s`` once every plan that long wanted fewer."""
    wanted = bounds.clamp(wanted)
    if wanted >= current:
        return wanted, ()
    wants = (*wants, (now_s, wanted))
    if now_s - wants[0][0] + 1e-9 < delay_s:
        return current, wants
    return max(count for _, count in wants), ()


def _plan_prefill(config: PlannerConfig, state: PlannerState, signals: Sequence[ReplicaSignals],
                  current: int) -> tuple[int, PlannerState, dict]:
    """Prefill replicas wanted (before the scale-down delay): tokens arriving = computed + the queue's growth."""
    queued = _sum(signals, "queued_prefill_tokens")
    computed = _sum(signals, "prefill_tokens")
    previous = state.queued_prefill_tokens if state.queued_prefill_tokens is not None else queued
    observed = max(0.0, computed + queued - previous) / config.period_s
    demand = state.prefill_demand.update(observed, config.smoothing)
    prompt, num_requests = state.prompt_tokens, _sum(signals, "num_requests")
    if num_requests:
        prompt = prompt.update(computed / num_requests, config.smoothing)
    prompt_tokens = prompt.level or 0.0
    capacity = config.capacity.prefill_tokens_per_s
    correction = state.prefill_correction
    if queued <= max(1, current) * capacity * config.slo.ttft_s:  # keeping up: the latency is the profile's
        correction = _corrected(correction, _worst(signals, "ttft_p90_s"),
                                prefill_ttft_s(max(1, current), observed, prompt_tokens, capacity),
                                config.correction_smoothing)
    forecast = max(demand.ahead(config.forecast_periods), observed) + queued / config.backlog_drain_s
    wanted = _fewest_prefill(config, forecast, prompt_tokens, correction)
    if wanted < current:  # going down: only as far as carries the demand with hysteresis to spare
        wanted = max(wanted, _fewest_prefill(config, forecast * (1 + config.hysteresis), prompt_tokens, correction))
    state = replace(state, prefill_demand=demand, prompt_tokens=prompt, queued_prefill_tokens=queued,
                    prefill_correction=correction)
    slo_met = prefill_ttft_target_s(config, prompt_tokens, correction) == config.slo.ttft_s
    return wanted, state, {"prefill_tokens_per_s": round(forecast, 1), "prompt_tokens": round(prompt_tokens, 1),
                           "prefill_correction": round(correction, 3), "prefill_slo_met": slo_met}


def _plan_decode(config: PlannerConfig, state: PlannerState, signals: Sequence[ReplicaSignals],
                 current: int) -> tuple[int, PlannerState, dict]:
    """Decode replicas wanted (before the scale-down delay): sequences in flight over what one replica holds."""
    capacity = config.capacity
    running = _sum(signals, "running_seqs")
    seqs = running + _sum(signals, "waiting_seqs")
    demand = state.decode_demand.update(seqs, config.smoothing)
    busiest = max((s.running_seqs for s in signals), default=0)
    correction = state.decode_correction
    if busiest <= capacity.decode_seqs(config.slo.itl_s):  # keeping up: the latency is the profile's
        correction = _corrected(correction, _worst(signals, "itl_p90_s"),
                                capacity.decode_itl_s(busiest) if busiest else 0.0, config.correction_smoothing)
    per_replica = capacity.decode_seqs(config.slo.itl_s / correction)
    kv_used, kv_total = _sum(signals, "kv_blocks_used"), _sum(signals, "kv_blocks_total")
    if running and kv_used and kv_total:  # the KV a replica has, over what a running sequence holds now
        per_replica = min(per_replica, kv_total / len(signals) / (kv_used / running))
    per_replica = max(per_replica, 1.0) * config.decode_utilization
    forecast = max(demand.ahead(config.forecast_periods), seqs)
    wanted = math.ceil(forecast / per_replica - 1e-9)
    if wanted < current:
        wanted = max(wanted, math.ceil(forecast * (1 + config.hysteresis) / per_replica - 1e-9))
    state = replace(state, decode_demand=demand, decode_correction=correction)
    return wanted, state, {"decode_seqs": round(forecast, 1), "decode_seqs_per_replica": round(per_replica, 1),
                           "decode_correction": round(correction, 3)}


def plan_prefill(config: PlannerConfig, state: PlannerState, signals: Sequence[ReplicaSignals], current: int,
                 now_s: float) -> tuple[int, PlannerState, dict]:
    """The prefill pool's count for the next period, from the last period's report of each of its replicas.

    ``current`` is the pool's target count. Returns the count, the state to
    pass next time, and the figures it planned from (for logs and metrics).
    """
    wanted, state, why = _plan_prefill(config, state, signals, current)
    count, wants = _settle(config.prefill, current, wanted, state.prefill_wants, now_s, config.scale_down_delay_s)
    return count, replace(state, prefill_wants=wants), why


def plan_decode(config: PlannerConfig, state: PlannerState, signals: Sequence[ReplicaSignals], current: int,
                now_s: float) -> tuple[int, PlannerState, dict]:
    """The decode pool's count for the next period; as ``plan_prefill``."""
    wanted, state, why = _plan_decode(config, state, signals, current)
    count, wants = _settle(config.decode, current, wanted, state.decode_wants, now_s, config.scale_down_delay_s)
    return count, replace(state, decode_wants=wants), why


def plan(config: PlannerConfig, state: PlannerState, prefill: Sequence[ReplicaSignals],
         decode: Sequence[ReplicaSignals], num_prefill: int, num_decode: int, now_s: float) -> tuple[Plan, PlannerState]:
    """Both pools' counts for the next period, from the last period's reports of each pool's replicas.

    ``num_prefill`` and ``num_decode`` are the pools' current target counts;
    ``prefill`` and ``decode`` hold one report per replica that sent one (a
    replica that did not is left out, and the pool's sums are of those that did).
    The two pools are planned independently: each reads only its own signals.
    """
    next_prefill, state, prefill_why = plan_prefill(config, state, prefill, num_prefill, now_s)
    next_decode, state, decode_why = plan_decode(config, state, decode, num_decode, now_s)
    return Plan(next_prefill, next_decode, {**prefill_why, **decode_why}), state
