"""The planner inside Ray Serve: what each replica reports, and the autoscaling policy that reads it.

A replica's ``record_autoscaling_stats`` returns ``replica_metrics``: its
engine's counters and load (``EngineStats`` names) and the TTFT or ITL p90
it saw over the last period. Serve records them on the replica, pushes them
to its controller, and calls the deployment's autoscaling policy with them
(``AutoscalingContext.raw_metrics``).

``PlannerPolicy`` is that policy, one instance per pool (Serve builds it
from ``policy_kwargs``). Every ``period_s`` it turns what Serve kept of each
replica's reports (the last ``look_back_period_s``, one period: counters
become rates over it) into ``ReplicaSignals`` and calls ``plan_prefill``
or ``plan_decode``. Between plans it keeps the pool's target. The planner owns the scale-down
delay and hysteresis, so the app sets Serve's own ``upscale_delay_s`` and
``downscale_delay_s`` to 0 (Serve applies them on top of any custom policy).
Capacity is the configured figure where one is given, else measured from
the pool's step times (``autoscale.capacity``); with neither yet, the target
stays where it is. While fewer replicas report than the target holds (some
still starting), it never scales down, and the scale-down delay starts over.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from autoscale.capacity import StepSums, decode_step_line, prefill_tokens_per_s
from autoscale.planner import (
    Bounds,
    Capacity,
    PlannerConfig,
    PlannerState,
    ReplicaSignals,
    Slo,
    plan_decode,
    plan_prefill,
)
from pd.workload.stats import percentile

# Serve runs the policy in its controller, whose log keeps only Serve's logger: decisions go there.
logger = logging.getLogger("ray.serve")

POOLS = ("prefill", "decode")
STEP_KEYS = tuple(f.name for f in fields(StepSums))
# Counters the plan reads as rates; the gauges as the replica's state at its latest report.
COUNTERS = ("num_computed_prompt_tokens", "num_prefilled")
LATENCIES = ("ttft_p90_s", "itl_p90_s")
MAX_LATENCY_SAMPLES = 4096  # the most recent, per window: a p90 needs no more


class LatencyWindow:
    """Latencies observed over the last ``window_s`` seconds of ``clock``, for their p90."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCY_SAMPLES)

    def observe(self, seconds: float) -> None:
        self._samples.append((self.clock(), seconds))

    def p90(self) -> float | None:
        now = self.clock()
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        return percentile([value for _, value in self._samples], 90) if self._samples else None


def replica_metrics(stats: Any, num_prefilled: int, ttft: LatencyWindow | None,
                    itl: LatencyWindow | None) -> dict[str, float]:
    """What a replica reports (``stats``: its ``EngineStats``; ``num_prefilled``: prompts it finished, cumulative).

    A latency with no sample in its window is left out, never sent as a stand-in number.
    """
    report = {name: float(getattr(stats, name)) for name in STEP_KEYS}
    report.update(num_prefilled=float(num_prefilled), num_waiting_tokens=float(stats.num_waiting_tokens),
                  num_running=float(stats.num_running), num_waiting=float(stats.num_waiting),
                  num_used_blocks=float(stats.num_used_blocks),
                  num_total_blocks=float(stats.num_used_blocks + stats.num_free_blocks))
    for name, window in (("ttft_p90_s", ttft), ("itl_p90_s", itl)):
        value = window.p90() if window is not None else None
        if value is not None:
            report[name] = value
    return report


@dataclass(frozen=True)
class ReplicaReport:
    """What Serve holds of one replica's reports over its look-back window."""

    at: float  # the latest report's time
    values: dict[str, float]  # each metric's latest value; a latency only if sent with the latest report
    rates: dict[str, float]  # each counter's increase per second across the window (0 with one report)


def replica_reports(raw_metrics: dict[str, dict[Any, list]] | None) -> dict[str, ReplicaReport]:
    """Serve's ``raw_metrics`` (metric -> replica -> time series) as one ``ReplicaReport`` per replica id."""
    series_of: dict[str, dict[str, list]] = {}
    for name, per_replica in (raw_metrics or {}).items():
        for replica_id, series in per_replica.items():
            if series:
                key = getattr(replica_id, "unique_id", str(replica_id))
                series_of.setdefault(key, {})[name] = sorted(series, key=lambda point: point.timestamp)
    reports = {}
    for replica_id, named in series_of.items():
        at = max(series[-1].timestamp for series in named.values())
        values = {name: series[-1].value for name, series in named.items()
                  if name not in LATENCIES or series[-1].timestamp >= at}
        rates = {}
        for name in COUNTERS:
            series = named.get(name)
            if series:
                span = series[-1].timestamp - series[0].timestamp
                rates[name] = max(0.0, series[-1].value - series[0].value) / span if span > 0 else 0.0
        reports[replica_id] = ReplicaReport(at, values, rates)
    return reports


class PlannerPolicy:
    """A Serve autoscaling policy (``policy_function``) that runs ``autoscale.planner`` for one pool.

    ``policy_kwargs``: ``pool`` ("prefill" or "decode"); ``slo_s`` (TTFT for
    prefill, ITL for decode); ``planner``, ``PlannerConfig`` fields other than
    the SLO, capacity and bounds; and ``capacity``, the configured
    ``Capacity`` fields of this pool (the rest are measured).
    """

    def __init__(self, pool: str, slo_s: float, planner: dict | None = None, capacity: dict | None = None) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.pool = pool
        self.slo = Slo(ttft_s=slo_s, itl_s=math.inf) if pool == "prefill" else Slo(ttft_s=math.inf, itl_s=slo_s)
        self.planner = dict(planner or {})
        self.capacity = dict(capacity or {})
        PlannerConfig(self.slo, self._capacity(StepSums(), fallback=True), **self.planner)  # its checks, now
        self.period_s = self.planner.get("period_s", PlannerConfig.period_s)
        self.state = PlannerState()
        self.planned_at: float | None = None

    def _capacity(self, sums: StepSums, fallback: bool = False) -> Capacity | None:
        """Configured figures first, then measured; ``fallback`` fills unknowns for a config check only.

        Only this pool's figures are read by its plan; the other pool's are placeholders.
        """
        if self.pool == "prefill":
            rate = self.capacity.get("prefill_tokens_per_s") or prefill_tokens_per_s(sums)
            if rate is None and not fallback:
                return None
            return Capacity(prefill_tokens_per_s=rate or 1.0, decode_step_s=0.0, decode_step_per_seq_s=1.0)
        configured = self.capacity.get("decode_step_s"), self.capacity.get("decode_step_per_seq_s")
        line = configured if None not in configured else decode_step_line(sums)
        if line is None and not fallback:
            return None
        step_s, per_seq_s = line or (0.0, 1.0)
        return Capacity(prefill_tokens_per_s=1.0, decode_step_s=step_s, decode_step_per_seq_s=per_seq_s)

    def _signals(self, reports: dict[str, ReplicaReport]) -> list[ReplicaSignals]:
        """One ``ReplicaSignals`` per replica that reported: counters as their rate over a period."""
        signals = []
        for report in reports.values():
            if "num_running" not in report.values:
                continue
            per_period = {name: rate * self.period_s for name, rate in report.rates.items()}
            value = report.values
            signals.append(ReplicaSignals(
                prefill_tokens=round(per_period.get("num_computed_prompt_tokens", 0.0)),
                queued_prefill_tokens=round(value.get("num_waiting_tokens", 0.0)),
                num_requests=round(per_period.get("num_prefilled", 0.0)),
                running_seqs=round(value.get("num_running", 0.0)), waiting_seqs=round(value.get("num_waiting", 0.0)),
                kv_blocks_used=round(value.get("num_used_blocks", 0.0)),
                kv_blocks_total=round(value.get("num_total_blocks", 0.0)),
                ttft_p90_s=value.get("ttft_p90_s"), itl_p90_s=value.get("itl_p90_s")))
        return signals

    def decide(self, reports: dict[str, ReplicaReport], current: int, bounds: Bounds,
               now_s: float) -> tuple[int, dict]:
        """The pool's target now: ``current`` until a period has passed since the last plan."""
        if self.planned_at is not None and now_s - self.planned_at + 1e-6 < self.period_s:
            return current, {}
        sums = sum((StepSums(**{k: report.values[k] for k in STEP_KEYS if k in report.values})
                    for report in reports.values()), StepSums())
        capacity = self._capacity(sums)
        signals = self._signals(reports)
        self.planned_at = now_s
        if capacity is None:
            return current, {"capacity": "not measured yet"}
        config = PlannerConfig(self.slo, capacity, **{self.pool: bounds}, **self.planner)
        step = plan_prefill if self.pool == "prefill" else plan_decode
        count, self.state, why = step(config, self.state, signals, current, now_s)
        if count < current <= bounds.max_replicas and len(signals) < current:
            # Replicas of the target still starting: the demand is no lower for their silence, and
            # scaling down now would stop one before it served. The delay starts once all report.
            count = current
            self.state = replace(self.state, prefill_wants=(), decode_wants=())
            why = {**why, "waiting_for_replicas": current - len(signals)}
        why = {**why, "capacity": _capacity_figures(capacity, self.pool)}
        if count != current:
            logger.info("planner: %s pool %d -> %d replicas (%s)", self.pool, current, count, why)
        return count, why

    def __call__(self, ctx) -> tuple[int, dict]:
        """Serve's entry point: an ``AutoscalingContext`` in, the target count and policy state out."""
        bounds = Bounds(max(1, ctx.capacity_adjusted_min_replicas),
                        max(1, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas))
        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        count, _ = self.decide(replica_reports(ctx.raw_metrics), ctx.target_num_replicas, bounds, now_s)
        return count, {}


def _capacity_figures(capacity: Capacity, pool: str) -> dict[str, float]:
    if pool == "prefill":
        return {"prefill_tokens_per_s": round(capacity.prefill_tokens_per_s, 1)}
    return {"decode_step_s": round(capacity.decode_step_s, 5),
            "decode_step_per_seq_s": round(capacity.decode_step_per_seq_s, 6)}
