"""Autoscaling in simulated time: the planner, a static fleet and Ray Serve's default policy, on one cluster.

Every ``period_s`` an ``Autoscaler`` reads the pools and returns the replica
counts it wants; ``run`` starts replicas (serving after ``startup_s``) or
retires the least busy (``sim.pool``: a retired replica drains first).

- ``PlannerAutoscaler``: the app's Serve policy (``autoscale.serve.PlannerPolicy``)
  per pool, fed each replica's report as a Serve replica sends it: its
  engine's own counters and load, and the period's TTFT and ITL p90.
- ``RayDefaultAutoscaler``: Ray Serve's own ``replica_queue_length_autoscaling_policy``
  per pool, with ``AutoscalingConfig``'s defaults (2 ongoing requests per
  replica, averaged over 30 s; up after 30 s, down after 600 s), its scaling
  factors and delay logic run on the simulated clock. Ray's controller
  decides every 0.1 s; here every ``period_s``.
- ``StaticAutoscaler``: fixed counts.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

from autoscale.planner import Capacity, PlannerConfig
from autoscale.serve import LatencyWindow, PlannerPolicy, replica_metrics, replica_reports
from sim.cluster import SimCluster
from sim.cost import CostModel, StepShape
from sim.pool import SimPool


class Autoscaler(Protocol):
    period_s: float

    def decide(self, cluster: SimCluster) -> tuple[int, int]:
        """``(prefill, decode)`` replicas wanted now."""


def capacity(cost: CostModel, max_num_batched_tokens: int, context_tokens: int) -> Capacity:
    """One replica's capacity under ``cost``: full prefill chunks, and decode steps at ``context_tokens`` each."""
    chunk = StepShape(num_tokens=max_num_batched_tokens, attn_pairs=max_num_batched_tokens * context_tokens,
                      num_seqs=1, num_samples=1)
    one = StepShape(num_tokens=1, attn_pairs=context_tokens, num_seqs=1, num_samples=1)
    empty = StepShape(num_tokens=0, attn_pairs=0, num_seqs=0, num_samples=0)
    return Capacity(prefill_tokens_per_s=max_num_batched_tokens / cost.step_seconds(chunk),
                    decode_step_s=cost.step_seconds(empty),
                    decode_step_per_seq_s=cost.step_seconds(one) - cost.step_seconds(empty))


class StaticAutoscaler:
    def __init__(self, num_prefill: int, num_decode: int, period_s: float = 10.0) -> None:
        self.counts = (num_prefill, num_decode)
        self.period_s = period_s

    def decide(self, cluster: SimCluster) -> tuple[int, int]:
        return self.counts


class _Window:
    """What the cluster's requests saw since the last read: TTFTs and inter-token gaps."""

    def __init__(self) -> None:
        self._live: dict[str, object] = {}
        self._seen = 0
        self._since_s = 0.0

    def read(self, cluster: SimCluster) -> tuple[list[float], list[float]]:
        new = itertools.islice(cluster.records.items(), self._seen, None)
        watched = {**self._live, **dict(new)}
        self._seen = len(cluster.records)
        since, ttfts, gaps = self._since_s, [], []
        for record in watched.values():
            times = record.token_times_s
            if times and times[0] >= since:
                ttfts.append(times[0] - record.arrival_s)
            for before, after in zip(reversed(times[:-1]), reversed(times)):
                if after < since:
                    break
                gaps.append(after - before)
        self._live = {rid: r for rid, r in watched.items() if r.finished_s is None}
        self._since_s = cluster.loop.now
        return ttfts, gaps


class _Point(NamedTuple):
    """A point of a metric's time series, as Serve's controller keeps them (``TimeStampedValue``)."""

    timestamp: float
    value: float


class PlannerAutoscaler:
    """Serve's planner policy for each pool (``autoscale.serve.PlannerPolicy``), fed what Serve would give it.

    Each period every replica reports ``replica_metrics``, as its
    ``record_autoscaling_stats`` does; Serve's controller keeps one period of
    them, so the policy sees each replica's report now and a period ago. The
    latencies are the whole cluster's over the period (TTFT from arrival, ITL
    between tokens), given to every replica of the pool they belong to.
    Capacity is the profile's (``config.capacity``): the simulated steps take
    no measurable time.
    """

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.period_s = config.period_s
        planner = {f.name: getattr(config, f.name) for f in fields(config)
                   if f.name not in ("slo", "capacity", "prefill", "decode")}
        cap = config.capacity
        self.policies = {
            "prefill": PlannerPolicy("prefill", config.slo.ttft_s, planner,
                                     {"prefill_tokens_per_s": cap.prefill_tokens_per_s}),
            "decode": PlannerPolicy("decode", config.slo.itl_s, planner,
                                    {"decode_step_s": cap.decode_step_s,
                                     "decode_step_per_seq_s": cap.decode_step_per_seq_s}),
        }
        self.plans: list[tuple[float, dict]] = []
        self._window = _Window()
        self._before: dict[str, tuple[float, dict[str, float]]] = {}  # replica id -> (time, its last report)

    def _raw_metrics(self, pool: SimPool, ttft: LatencyWindow | None, itl: LatencyWindow | None,
                     now_s: float) -> dict[str, dict[str, list]]:
        """Serve's ``raw_metrics`` of ``pool``: metric -> replica id -> its reports of the last period."""
        raw: dict[str, dict[str, list]] = {}
        for replica_id in pool.replica_ids:
            stats = pool.replicas[replica_id].engine.stats()
            report = replica_metrics(stats, pool.num_routed[replica_id], ttft, itl)
            before_s, before = self._before.get(replica_id, (None, {}))
            self._before[replica_id] = (now_s, report)
            for name, value in report.items():
                series = [_Point(before_s, before[name])] if name in before else []
                raw.setdefault(name, {})[replica_id] = [*series, _Point(now_s, value)]
        return raw

    def decide(self, cluster: SimCluster) -> tuple[int, int]:
        now_s = cluster.loop.now
        ttfts, gaps = self._window.read(cluster)
        counts, why = [], {}
        for name, pool, samples in (("prefill", cluster.prefill, ttfts), ("decode", cluster.decode, gaps)):
            window = LatencyWindow(self.period_s, clock=lambda: now_s)
            for sample in samples:
                window.observe(sample)
            ttft, itl = (window, None) if name == "prefill" else (None, window)
            reports = replica_reports(self._raw_metrics(pool, ttft, itl, now_s))
            count, pool_why = self.policies[name].decide(reports, pool.num_target, getattr(self.config, name), now_s)
            counts.append(count)
            why.update(pool_why)
        self.plans.append((now_s, why))
        return counts[0], counts[1]


class RayDefaultAutoscaler:
    """Ray Serve's default policy for each pool, on ongoing requests (in flight at each replica)."""

    def __init__(self, prefill_bounds: tuple[int, int], decode_bounds: tuple[int, int], period_s: float = 1.0,
                 **config_overrides) -> None:
        # sim's one door to Ray, imported here so that the simulator imports without it.
        from autoscale.ray_internals import autoscaling_config

        self.period_s = period_s
        self.configs = {
            "prefill": autoscaling_config(*prefill_bounds, **config_overrides),
            "decode": autoscaling_config(*decode_bounds, **config_overrides),
        }
        self._samples = {name: deque() for name in self.configs}
        self._state: dict[str, dict] = {name: {} for name in self.configs}

    def _decide_pool(self, name: str, pool: SimPool, now_s: float) -> int:
        from autoscale.ray_internals import ray_default_replicas

        config, samples = self.configs[name], self._samples[name]
        samples.append((now_s, sum(pool.in_flight(r) for r in pool.replica_ids)))
        while samples[0][0] < now_s - config.look_back_period_s:
            samples.popleft()
        ongoing = sum(value for _, value in samples) / len(samples)
        decided, self._state[name] = ray_default_replicas(name, config, ongoing, len(pool.replica_ids),
                                                          pool.num_target, self._state[name], now_s)
        return max(config.min_replicas, min(config.max_replicas, math.ceil(decided)))

    def decide(self, cluster: SimCluster) -> tuple[int, int]:
        now_s = cluster.loop.now
        return self._decide_pool("prefill", cluster.prefill, now_s), self._decide_pool("decode", cluster.decode, now_s)


@dataclass
class Timeline:
    """Replicas serving or starting in each pool after each decision, and when."""

    times_s: list[float]
    num_prefill: list[int]
    num_decode: list[int]


def _resize(pool: SimPool, target: int, startup_s: float) -> None:
    while pool.num_target < target:
        pool.add(startup_s)
    while pool.num_target > target:
        pool.retire_newest_starting_or_least_busy()


def run(cluster: SimCluster, autoscaler: Autoscaler, until_s: float, startup_s: float) -> Timeline:
    """Let ``autoscaler`` size ``cluster``'s pools every period until ``until_s`` (the trace is submitted already)."""
    timeline = Timeline([], [], [])
    loop = cluster.loop

    def tick() -> None:
        num_prefill, num_decode = autoscaler.decide(cluster)
        _resize(cluster.prefill, num_prefill, startup_s)
        _resize(cluster.decode, num_decode, startup_s)
        timeline.times_s.append(loop.now)
        timeline.num_prefill.append(cluster.prefill.num_target)
        timeline.num_decode.append(cluster.decode.num_target)
        if loop.now + autoscaler.period_s <= until_s:
            loop.at(loop.now + autoscaler.period_s, tick)

    loop.at(autoscaler.period_s, tick)
    loop.run()
    return timeline
