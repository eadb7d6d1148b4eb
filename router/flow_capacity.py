"""What flow control knows of capacity: the replicas' reports, the rate its queue drains at, tenants' quotas.

**Saturation** (``Capacity``), from each replica's own report, as llm-d's
detector judges it: a replica has room while its report is fresh (no older
than ``max_report_age_s``), its engine's queue is under ``max_waiting``,
its KV use under ``max_kv_usage`` and, where given, the routers' predicted
prompt backlog there under ``max_backlog_s`` and its predicted decode step
(the inter-token latency of the decodes it reported) under ``max_step_s``:
a batch grown past the latency its streams are promised is as full as a
queue. A pool is *full* when none of
its replicas has room, and *stale* when none has a fresh report.

A request must wait (``saturated``) when some pool is stale; or, while
requests wait here already or some pool is full, when this ingress has
``limit`` requests in flight. Otherwise (nothing waits and every pool has
room) it goes at once, bursts included: below saturation flow control
holds nothing back.

Reports come every second or so and a request may finish at any moment,
so the room a backlog is released into is a limit on the requests in
flight, set at each report::

    limit = base + min over pools of  sum over its replicas of  slack(r) / num_ingress
    slack(r) = max_waiting - num_waiting(r)            fresh, under the KV and backlog bounds
             = min(0, max_waiting - num_waiting(r))    over a bound: no room, its excess still counts
             = 0                                       stale: neither room nor excess known
    base     = the most requests in flight since the last report, where every pool has room
               (the engines took them all); those in flight now, where some pool has none

and, while every fresh replica's queue is at most half ``max_waiting``
(the engines keep up), at least ``base * (1 + growth)``: ``IDLE_GROWTH``
without a backlog, ``BACKLOG_GROWTH`` with one (a backlog released faster
overshoots, and the engines' queues swing between empty and far past
``max_waiting``). A request that finishes frees its place at once; under
overload the engines' queues settle near ``max_waiting`` deep, where flow
control, not the engine's first-come order, decides who goes next. Until
any pool has reported, nothing is known and nothing is held back.

**Drain rate** (``DrainRate``): tokens dispatched per second while
requests waited, decayed over ``half_life_s`` of such time: how fast the
queue ahead of a request empties. Requests that arrive later may still pass
it (a more urgent band, or a lighter tenant's turn under fair queuing), each
stream at its recent rate up to the room it has ahead of it
(``FlowQueue.ahead_and_room``); ``queue_wait_s`` solves for the wait with
them::

    drain * wait = ahead + sum over streams of min(rate * wait, room)

**Quotas** (``TokenBucket``): a tenant's tokens per minute, a bucket of one
minute's tokens refilled continuously.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.flow_config import SaturationConfig
from router.latency import LatencyPredictor
from router.protocol import RoutingStats
from router.step_cost import StepShape, linear_seconds

# The fewest requests the ingress may have in flight, so that a finished request can always be followed.
MIN_LIMIT = 1
# How much the limit may grow past the requests in flight at a report whose every queue is at most half full,
# without requests waiting here and with them (module docstring).
IDLE_GROWTH = 1.0
BACKLOG_GROWTH = 0.5


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's load as flow control reads it (``of``: from its ``RoutingStats``)."""

    num_waiting: int
    kv_usage: float
    backlog_s: float | None = None  # the routers' predicted prompt work queued there (LatencyPredictor.wait_s)
    step_s: float | None = None  # the routers' predicted decode step at its reported decodes

    @classmethod
    def of(cls, stats: RoutingStats, backlog_s: float | None = None, step_s: float | None = None) -> "ReplicaReport":
        return cls(stats.num_waiting, stats.kv_usage, backlog_s, step_s)


class Capacity:
    """Whether the pools have room, and how many requests this ingress may have in flight (module docstring).

    ``num_ingress``: the ingress replicas sharing the pools, each taking its share of their room.
    """

    def __init__(self, config: SaturationConfig, num_ingress: int = 1) -> None:
        if num_ingress < 1:
            raise ValueError(f"num_ingress must be >= 1, got {num_ingress}")
        self.config = config
        self.num_ingress = num_ingress
        self._reports: dict[str, dict[str, tuple[ReplicaReport, float]]] = {}
        self.limit: int | None = None  # None until a report came
        self._peak_in_flight = 0  # since the last report

    def note_in_flight(self, num_in_flight: int) -> None:
        """The requests in flight after an admission."""
        self._peak_in_flight = max(self._peak_in_flight, num_in_flight)

    def observe(self, pool: str, replica_id: str, report: ReplicaReport, now_s: float, num_in_flight: int,
                backlogged: bool = False) -> None:
        """``replica_id`` of ``pool`` reported ``report`` at ``now_s``, with ``num_in_flight`` requests out and
        requests waiting for room (``backlogged``) or not."""
        self._reports.setdefault(pool, {})[replica_id] = (report, now_s)
        slack = min(self.slack(name, now_s) for name in self._reports)
        base = max(self._peak_in_flight, num_in_flight) if slack > 0 else num_in_flight
        limit = base + int(slack / self.num_ingress)
        if self._keeping_up(now_s):
            limit = max(limit, math.ceil(base * (1 + (BACKLOG_GROWTH if backlogged else IDLE_GROWTH))))
        self.limit = max(MIN_LIMIT, limit)
        self._peak_in_flight = num_in_flight

    def forget(self, pool: str, replica_id: str) -> None:
        """A replica gone: its report no longer counts."""
        self._reports.get(pool, {}).pop(replica_id, None)

    def slack(self, pool: str, now_s: float) -> int:
        return sum(self._slack(report, at_s, now_s) for report, at_s in self._reports.get(pool, {}).values())

    def _slack(self, report: ReplicaReport, at_s: float, now_s: float) -> int:
        config = self.config
        if now_s - at_s > config.max_report_age_s:
            return 0
        room = config.max_waiting - report.num_waiting
        full = report.kv_usage >= config.max_kv_usage or _over(report.backlog_s, config.max_backlog_s) \
            or _over(report.step_s, config.max_step_s)
        return min(0, room) if full else room

    def _keeping_up(self, now_s: float) -> bool:
        """Every fresh replica's queue at most half ``max_waiting`` and under the bounds (and some replica fresh)."""
        fresh = [(report, at_s) for reports in self._reports.values() for report, at_s in reports.values()
                 if now_s - at_s <= self.config.max_report_age_s]
        half = self.config.max_waiting // 2
        return bool(fresh) and all(report.num_waiting <= half and self._slack(report, at_s, now_s) > 0
                                   for report, at_s in fresh)

    def full_pools(self, now_s: float) -> list[str]:
        """Pools none of whose replicas has room (as its last report says)."""
        return sorted(pool for pool, reports in self._reports.items()
                      if not any(self._slack(report, at_s, now_s) > 0 for report, at_s in reports.values()))

    def stale_pools(self, now_s: float) -> list[str]:
        """Pools with no replica's report fresh: saturated whatever else is known."""
        age = self.config.max_report_age_s
        return sorted(pool for pool, reports in self._reports.items()
                      if not any(now_s - at_s <= age for _, at_s in reports.values()))

    def saturated(self, now_s: float, num_in_flight: int, backlogged: bool = True, share: float = 1.0) -> bool:
        """Whether a request must wait (module docstring); ``backlogged``: requests wait here already; ``share``:
        the part of the limit its level may fill (``FlowController``: the rest is left to the levels above)."""
        if self.limit is None:
            return False  # nothing reported yet: nothing to hold requests back for
        if self.stale_pools(now_s):
            return True
        if not backlogged and not self.full_pools(now_s):
            return False
        return num_in_flight >= self.limit * share


def decode_step_s(predictor: LatencyPredictor, replica_id: str, stats: RoutingStats) -> float | None:
    """The predicted time of ``replica_id``'s decode step at the decodes ``stats`` report (its inter-token
    latency), from the step cost model ``predictor`` fits; None without decodes or before it is ready."""
    if not predictor.ready() or not stats.num_decoding:
        return None
    decodes = stats.num_decoding
    shape = StepShape(num_tokens=decodes, attn_pairs=stats.num_decode_context_tokens + decodes, num_seqs=decodes,
                      num_samples=decodes)
    return predictor.fit.speed(replica_id) * linear_seconds(predictor.fit.coefficients(), shape.vector())


def _over(value: float | None, bound: float | None) -> bool:
    return bound is not None and value is not None and value >= bound


class DrainRate:
    """Tokens dispatched per second while requests waited, decayed over ``half_life_s`` of such time (idle time
    neither counts nor ages it); None until requests have waited ``min_span_s`` (decayed) in all."""

    def __init__(self, half_life_s: float = 10.0, min_span_s: float = 1.0) -> None:
        if not (half_life_s > 0 and min_span_s > 0):
            raise ValueError(f"half_life_s and min_span_s must be > 0, got {half_life_s} and {min_span_s}")
        self.half_life_s = half_life_s
        self.min_span_s = min_span_s
        self._tokens = 0.0
        self._span_s = 0.0
        self._at_s: float | None = None
        self._backlogged = False

    def note(self, now_s: float, backlogged: bool, dispatched_tokens: int = 0) -> None:
        """The state at ``now_s``: ``dispatched_tokens`` left the queue since the last note (counted where
        requests waited since then), and whether requests wait now (the state until the next note)."""
        if self._at_s is not None and self._backlogged:
            elapsed = max(0.0, now_s - self._at_s)
            decay = 0.5 ** (elapsed / self.half_life_s)
            self._tokens = self._tokens * decay + dispatched_tokens
            self._span_s = self._span_s * decay + elapsed
        self._at_s = now_s
        self._backlogged = backlogged

    def tokens_per_s(self) -> float | None:
        if self._span_s < self.min_span_s or self._tokens <= 0:
            return None
        return self._tokens / self._span_s


def queue_wait_s(ahead: float, drain_per_s: float, streams: list[tuple[float, float]]) -> float:
    """The least ``wait`` with ``drain_per_s * wait = ahead + sum(min(rate * wait, room))`` over ``streams`` of
    ``(rate, room)`` (tokens per second that may pass, and at most how many): math.inf where streams without
    bound arrive as fast as the queue drains."""
    pending = sorted((room / rate_in, rate_in, room) for rate_in, room in streams if rate_in > 0 and room > 0)
    fixed = 0.0  # the room of streams that have used it up
    rate = sum(rate_in for _, rate_in, _ in pending)  # the streams still passing
    for full_at, rate_in, room in pending:
        if drain_per_s > rate:
            wait = (ahead + fixed) / (drain_per_s - rate)
            if wait <= full_at:
                return wait
        if math.isinf(room):
            return math.inf
        fixed, rate = fixed + room, rate - rate_in
    return (ahead + fixed) / drain_per_s


class TokenBucket:
    """``tokens_per_min``, refilled continuously into a bucket of one minute's tokens; full at first."""

    def __init__(self, tokens_per_min: int) -> None:
        if tokens_per_min < 1:
            raise ValueError(f"tokens_per_min must be >= 1, got {tokens_per_min}")
        self.capacity = float(tokens_per_min)
        self.rate_per_s = tokens_per_min / 60.0
        self._level = self.capacity
        self._at_s: float | None = None

    def level(self, now_s: float) -> float:
        self._refill(now_s)
        return self._level

    def take(self, tokens: int, now_s: float) -> bool:
        """Take ``tokens`` if the bucket holds them; False (and nothing taken) otherwise."""
        self._refill(now_s)
        if self._level < tokens:
            return False
        self._level -= tokens
        return True

    def give_back(self, tokens: float, now_s: float) -> None:
        """Tokens taken and not used (a request shed, or one that stopped short of its output bound)."""
        self._refill(now_s)
        self._level = min(self.capacity, self._level + max(0.0, tokens))

    def _refill(self, now_s: float) -> None:
        if self._at_s is not None and now_s > self._at_s:
            self._level = min(self.capacity, self._level + (now_s - self._at_s) * self.rate_per_s)
        self._at_s = now_s if self._at_s is None else max(self._at_s, now_s)

