"""Flow control at the ingress: admit, hold or shed each request before any compute is spent on it.

    classify ──> decide ──> Admit ─────────────────────────> the pools
                   │  └───> Shed(reason, retry_after_s) ──> 429 + Retry-After
                   └──────> Wait ──> queue ──poll──> Admit | Shed (expired, displaced)

**Who and how urgent** (``router.flow_config``): tenant, priority, band,
deadline and cost in tokens. **Quotas**: a tenant's tokens per minute
(``TokenBucket``). A request over its tenant's quota is not refused: it
*borrows*, waiting in a level below every band, so it runs only on
capacity nobody else wants and is the first shed when they want it back.
Counters and outcomes name its own band (``borrowing`` says it was over
quota); ``Admit.level`` (the borrowed level is ``len(bands)``) is what
the engine's priority takes.

**Order** (``router.flow_queue``): bands strictly in order; within a band,
tenants by weighted fair queuing in tokens; within a tenant, earliest
deadline first.

**Saturation** (``router.flow_capacity.Capacity``): from the replicas'
reports. A request with nothing waiting ahead of it is admitted at once
unless a pool's reports are stale, or they say a pool is full, or
requests wait already and this ingress has its limit in flight; then it
waits, and ``poll`` admits the queue in order as places free. With
``band_reserve`` (off by default), each level may fill only
``(1 - band_reserve) ** level`` of the limit, so the levels above always
find places the ones below cannot take: a batch stream holds its place for
the whole of its output, and without a reserve an interactive request
waits for one to end (served at 2x: 1.3 s at the median, 14 in flight).
It costs the lower bands their latency below overload (simulated at 0.7x
with a reserve of 0.25: TTFT p99 2.4x), which is why it is a choice.

**Shedding**, each counted per tenant, band and ``ShedReason``:

- ``DEADLINE``: at ``decide``, its predicted TTFT exceeds its deadline by
  more than ``shed_margin`` (a fraction of the deadline, for the
  prediction's error)::

      predicted = (now - arrival) + queue_wait + prediction.ttft_s
      queue_wait = queue_wait_s(tokens_ahead, drain rate, later arrivals)   (0 while the rate is unknown)

  ``prediction`` is the routers' (``router.latency.Prediction``: its
  ``ttft_s`` counts the replica's own queue); ``tokens_ahead`` is where it
  would stand here, which later arrivals of a more urgent band, or of a
  lighter tenant under fair queuing, may pass (``router.flow_capacity``):
  a heavy tenant's request is then shed on arrival, not left to expire.
- ``EXPIRED``: it waited until dispatching it now would miss the deadline
  itself: ``(now - arrival) + prediction.ttft_s >= deadline``. No margin
  here: the wait is past, not predicted, and a request dispatched late
  would take capacity from others only to miss (in simulation, a margin
  here admitted requests that missed and cut the band's goodput by a third).
- ``TENANT_QUEUE`` / ``QUEUE_FULL``: its tenant's queue, or the whole queue,
  is at its bound for the request's level: a request of level ``l`` queues
  only while fewer than ``bound * (1 - queue_reserve) ** l`` wait (rounded
  up). The levels above find the rest of the bound free, so a more urgent
  request rarely has to displace one, and a less urgent one that cannot
  wait is told at once, not after it has waited (in simulation, a reserve
  of 0.25 turned every displacement, 61% of them answered after 50 ms,
  into a shed on arrival).
- ``DISPLACED``: a queue at its bound for the request's level makes room by
  shedding the last waiting request of a lower level (borrowed first), never
  one of the same or a higher level: shedding never takes capacity from a
  higher band to serve a lower one.

``retry_after_s`` is the predicted drain of the queue ahead of it plus the
replica's own wait: when the place it would have had comes up.

**How the ingress drives it** (one event loop; nothing here blocks or
awaits, and ``now_s`` is a monotonic clock the caller reads)::

    controller = FlowController(args.flow_control.config(), num_ingress=args.ingress.num_replicas)
    request = controller.classify(request_id, FlowIdentity(api_key, headers.get("x-tenant-id"),
                                  headers.get("x-slo-ttft-ms"), body.priority), num_prompt_tokens,
                                  num_choices * max_tokens, arrival_s)   # FlowRequestError: 400 naming .field
    outcome = controller.decide(request, prediction, now_s)
    #   prediction: PoolPredictions.best(...) of the pool that will compute the prompt (the prefill pool's where
    #   the remote-prefill rule may send it there and its router predicts, else the decode pool's), or None
    #   Admit: call the pools, at outcome.level's priority;  Wait: await a future the poller resolves;
    #   Shed: 429, Retry-After: max(1, ceil(retry_after_s)), an OpenAI error body naming outcome.reason
    controller.poll(now_s)   # -> [Admit | Shed]: resolve each one's future; call it after every decide that
                             # returned Wait, every finished/cancel/observe, and at next_wake_s()
    controller.observe(pool, replica_id, ReplicaReport.of(stats, backlog_s), now_s)   # each routing report
    controller.forget(pool, replica_id)                                # a replica gone
    controller.finished(request_id, num_output_tokens, now_s)          # every admitted request, however it ends
    controller.cancel(request_id, now_s)                               # a waiting request's client left

The simulator (``sim.flow_gate``) drives it the same way from its event loop.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from router.flow_capacity import Capacity, DrainRate, ReplicaReport, TokenBucket, queue_wait_s
from router.flow_config import FlowConfig, FlowIdentity, FlowRequest
from router.flow_queue import FlowQueue, Queued
from router.inflow import Inflow
from router.latency import Prediction


class ShedReason(enum.Enum):
    DEADLINE = "deadline"
    EXPIRED = "expired"
    TENANT_QUEUE = "tenant_queue"
    QUEUE_FULL = "queue_full"
    DISPLACED = "displaced"

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    ShedReason.DEADLINE: "predicted time to first token exceeds the request's deadline",
    ShedReason.EXPIRED: "waited until the request's deadline could no longer be met",
    ShedReason.TENANT_QUEUE: "too many of the tenant's requests are waiting",
    ShedReason.QUEUE_FULL: "too many requests are waiting",
    ShedReason.DISPLACED: "shed to make room for a more urgent request",
}


@dataclass(frozen=True)
class Admit:
    """Send it to the pools now."""

    request: FlowRequest
    band: str  # its band's name (by its priority)
    level: int  # where it was queued, and what the engine's priority takes: its band's index, len(bands) borrowed
    borrowing: bool  # over its tenant's quota: served below every band
    waited_s: float  # in this queue


@dataclass(frozen=True)
class Wait:
    """Queued: ``poll`` answers it later with an ``Admit`` or a ``Shed``."""

    request: FlowRequest
    predicted_wait_s: float | None  # None while the drain rate is unknown


@dataclass(frozen=True)
class Shed:
    """Refused before any compute: 429 with ``Retry-After``."""

    request: FlowRequest
    reason: ShedReason
    retry_after_s: float
    band: str  # its band's name (by its priority)
    borrowing: bool  # over its tenant's quota
    predicted_ttft_s: float | None = None  # what the deadline was judged by (DEADLINE, EXPIRED)
    tokens_ahead: float = 0.0  # the queue ahead of it, in tokens
    queue_drain_s: float | None = None  # their predicted drain (retry_after_s less the replica's own wait)

    def message(self) -> str:
        return f"{self.reason.message} ({self.reason.value}); retry after {self.retry_after_s:.1f} s"


Outcome = Admit | Wait | Shed


@dataclass
class FlowCounters:
    """Everything flow control decided, for metrics: per (tenant, band) and reason, each request under the band
    its priority names (borrowed traffic too: ``borrowed`` counts it apart)."""

    admitted: Counter[tuple[str, str]] = field(default_factory=Counter)
    borrowed: Counter[str] = field(default_factory=Counter)  # admitted over quota, per tenant
    shed: Counter[tuple[str, str, ShedReason]] = field(default_factory=Counter)
    cancelled: Counter[tuple[str, str]] = field(default_factory=Counter)
    served_tokens: Counter[str] = field(default_factory=Counter)  # prompt + output of finished requests
    dispatched_tokens: int = 0  # the cost of every request admitted: what has left the queue, in its units


@dataclass
class _Held:
    """A request waiting or in flight, with what it was admitted under."""

    request: FlowRequest
    level: int
    borrowing: bool
    quota_taken: int  # tokens taken from its tenant's bucket, given back unused
    service_s: float  # predicted from dispatch to its first token (the routers' TTFT)
    replica_wait_s: float  # the part of it queued at the replica
    seq: int
    expire_at_s: float = math.inf


class FlowController:
    """Admission for one ingress replica (module docstring). Not thread-safe: one event loop calls it."""

    def __init__(self, config: FlowConfig, num_ingress: int = 1, drain_half_life_s: float = 10.0) -> None:
        self.config = config
        self.borrowed_level = len(config.bands)
        self.queue = FlowQueue(len(config.bands) + 1, {tenant.name: tenant.weight for tenant in config.tenants})
        self.capacity = Capacity(config.saturation, num_ingress)
        self.drain = DrainRate(drain_half_life_s)
        self.arrivals = Inflow(drain_half_life_s)  # tokens queued or admitted per second, by (level, tenant or None)
        self.buckets = {tenant.name: TokenBucket(tenant.quota_tokens_per_min) for tenant in config.tenants
                        if tenant.quota_tokens_per_min is not None}
        self.counters = FlowCounters()
        self._waiting: dict[str, _Held] = {}
        self._in_flight: dict[str, _Held] = {}
        self._expiries: list[tuple[float, int, str]] = []
        self._released: list[Admit | Shed] = []  # decided outside ``poll``, handed out by the next one
        self._seq = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def saturated(self, now_s: float, level: int = 0) -> bool:
        """Whether a request of ``level`` must wait: the requests in flight against its share of the limit."""
        share = (1.0 - self.config.saturation.band_reserve) ** level
        return self.capacity.saturated(now_s, len(self._in_flight), len(self.queue) > 0, share)

    def band_name(self, request: FlowRequest) -> str:
        return self.config.bands[request.band].name

    # The ingress's calls -------------------------------------------------------------

    def classify(self, request_id: str, identity: FlowIdentity, num_prompt_tokens: int, max_output_tokens: int,
                 arrival_s: float) -> FlowRequest:
        """``FlowConfig.classify``: raises ``FlowRequestError`` (400) naming the bad field."""
        return self.config.classify(request_id, identity, num_prompt_tokens, max_output_tokens, arrival_s)

    def decide(self, request: FlowRequest, prediction: Prediction | None, now_s: float) -> Outcome:
        """Admit, queue or shed ``request``; ``prediction``: the routers' best replica for its prompt, if any."""
        if request.request_id in self._waiting or request.request_id in self._in_flight:
            raise ValueError(f"request {request.request_id!r} was decided already")
        held = self._hold(request, prediction, now_s)
        limit_s = self._deadline_bound(request)
        elapsed = max(0.0, now_s - request.arrival_s)
        if not self.saturated(now_s, held.level) and self.queue.num_queued_through(held.level) == 0:
            if elapsed + held.service_s > limit_s:
                return self._shed(held, ShedReason.DEADLINE, now_s, held.replica_wait_s, elapsed + held.service_s)
            self.drain.note(now_s, len(self.queue) > 0, request.cost)
            self._arrived(held, now_s)
            return self._admit(held, now_s)
        ahead, room = self.queue.ahead_and_room(request.tenant, held.level, request.cost,
                                                (request.deadline_at_s, held.seq))
        wait_s = self._drain_s(ahead)
        predicted = elapsed + self._wait_s(ahead, room, now_s) + held.service_s
        retry_s = (self.config.saturation.max_report_age_s if wait_s is None else wait_s) + held.replica_wait_s
        if predicted > limit_s:
            return self._shed(held, ShedReason.DEADLINE, now_s, (wait_s or 0.0) + held.replica_wait_s, predicted,
                              ahead, wait_s)
        tenant = self.config.tenant(request.tenant)
        share = (1.0 - self.config.queue_reserve) ** held.level
        for bound, reason, of_tenant in ((tenant.max_queued, ShedReason.TENANT_QUEUE, request.tenant),
                                         (self.config.max_queued, ShedReason.QUEUE_FULL, None)):
            queued = len(self.queue) if of_tenant is None else self.queue.num_queued(of_tenant)
            if queued < math.ceil(bound * share):
                continue
            victim = self.queue.last(held.level, of_tenant)
            if victim is None:
                return self._shed(held, reason, now_s, retry_s, tokens_ahead=ahead, queue_drain_s=wait_s)
            self._released.append(self._shed_waiting(victim, ShedReason.DISPLACED, now_s))
        self._enqueue(held, now_s)
        self._arrived(held, now_s)
        return Wait(request, wait_s)

    def poll(self, now_s: float) -> list[Admit | Shed]:
        """What is decided now for waiting requests: the expired shed, then as many admitted as there is room
        for, in queue order; and whatever was shed since the last poll to make room."""
        out, self._released = self._released, []
        while self._expiries and self._expiries[0][0] <= now_s:
            _, seq, request_id = heapq.heappop(self._expiries)
            held = self._waiting.get(request_id)
            if held is not None and held.seq == seq:
                out.append(self._shed_waiting(self.queue.get(request_id), ShedReason.EXPIRED, now_s))
        dispatched = 0
        while len(self.queue) and not self.saturated(now_s, self.queue.peek().level):
            entry = self.queue.pop()
            dispatched += entry.cost
            out.append(self._admit(self._waiting.pop(entry.request_id), now_s))
        self.drain.note(now_s, len(self.queue) > 0, dispatched)
        return out

    def next_wake_s(self) -> float | None:
        """When the next waiting request expires, for the caller's timer; None while none can."""
        while self._expiries:
            expire_at, seq, request_id = self._expiries[0]
            held = self._waiting.get(request_id)
            if held is not None and held.seq == seq:
                return expire_at
            heapq.heappop(self._expiries)
        return None

    def finished(self, request_id: str, num_output_tokens: int, now_s: float) -> None:
        """An admitted request ended (done, failed or cancelled) after ``num_output_tokens``: its place frees."""
        held = self._in_flight.pop(request_id, None)
        if held is None:
            raise ValueError(f"request {request_id!r} is not in flight")
        used = held.request.num_prompt_tokens + num_output_tokens
        self.counters.served_tokens[held.request.tenant] += used
        if held.quota_taken > used:
            self.buckets[held.request.tenant].give_back(held.quota_taken - used, now_s)

    def cancel(self, request_id: str, now_s: float) -> bool:
        """A waiting request's client went away: it leaves the queue. False if it was not waiting."""
        held = self._waiting.pop(request_id, None)
        if held is None:
            return False
        self.queue.remove(request_id)
        self._give_back(held, now_s)
        self.counters.cancelled[held.request.tenant, self.band_name(held.request)] += 1
        return True

    def observe(self, pool: str, replica_id: str, report: ReplicaReport, now_s: float) -> None:
        """A replica's routing report: the room the pools have (``Capacity``)."""
        self.capacity.observe(pool, replica_id, report, now_s, len(self._in_flight), len(self.queue) > 0)

    def forget(self, pool: str, replica_id: str) -> None:
        self.capacity.forget(pool, replica_id)

    # Internals ------------------------------------------------------------------------

    def _hold(self, request: FlowRequest, prediction: Prediction | None, now_s: float) -> _Held:
        """Its level: its band, or the borrowed level when its tenant's bucket cannot pay its cost."""
        bucket = self.buckets.get(request.tenant)
        borrowing = bucket is not None and not bucket.take(request.cost, now_s)
        service_s = prediction.ttft_s if prediction is not None else 0.0
        replica_wait_s = max(0.0, prediction.ttft_s - prediction.compute_s) if prediction is not None else 0.0
        return _Held(request, self.borrowed_level if borrowing else request.band, borrowing,
                     0 if borrowing or bucket is None else request.cost, service_s, replica_wait_s, next(self._seq))

    def _deadline_bound(self, request: FlowRequest) -> float:
        if request.deadline_s is None:
            return math.inf
        return request.deadline_s * (1.0 + self.config.shed_margin)

    def _drain_s(self, tokens: float) -> float | None:
        rate = self.drain.tokens_per_s()
        return None if rate is None else tokens / rate

    def _wait_s(self, ahead: float, room: dict[tuple[int, str | None], float], now_s: float) -> float:
        """The queue's wait (``queue_wait_s``) with ``ahead`` and later arrivals' ``room``; 0 before a drain."""
        rate = self.drain.tokens_per_s()
        if rate is None:
            return 0.0
        return queue_wait_s(ahead, rate, [(self.arrivals.fraction(key, now_s), tokens) for key, tokens in room.items()])

    def _arrived(self, held: _Held, now_s: float) -> None:
        """``held`` joins the queue or goes at once: counted in the arrival rates ``_wait_s`` reads."""
        for key in ((held.level, held.request.tenant), (held.level, None)):
            self.arrivals.sent(key, held.request.cost, now_s)

    def _enqueue(self, held: _Held, now_s: float) -> None:
        request = held.request
        self._waiting[request.request_id] = held
        self.queue.push(Queued(request.request_id, request.tenant, held.level, request.cost, request.deadline_at_s,
                               held.seq))
        if request.deadline_s is not None and math.isfinite(self.config.shed_margin):
            held.expire_at_s = request.arrival_s + request.deadline_s - held.service_s
            heapq.heappush(self._expiries, (held.expire_at_s, held.seq, request.request_id))
        self.drain.note(now_s, True)

    def _admit(self, held: _Held, now_s: float) -> Admit:
        request = held.request
        self._in_flight[request.request_id] = held
        self.capacity.note_in_flight(len(self._in_flight))
        band = self.band_name(held.request)
        self.counters.admitted[request.tenant, band] += 1
        self.counters.dispatched_tokens += request.cost
        if held.borrowing:
            self.counters.borrowed[request.tenant] += 1
        return Admit(request, band, held.level, held.borrowing, max(0.0, now_s - request.arrival_s))

    def _shed_waiting(self, entry: Queued, reason: ShedReason, now_s: float) -> Shed:
        held = self._waiting.pop(entry.request_id)
        ahead = self.queue.tokens_ahead(entry.tenant, entry.level, entry.cost, entry.key)
        self.queue.remove(entry.request_id)
        wait_s = self._drain_s(ahead)
        retry_s = (self.config.saturation.max_report_age_s if wait_s is None else wait_s) + held.replica_wait_s
        predicted = None
        if reason is ShedReason.EXPIRED:
            predicted = now_s - held.request.arrival_s + (wait_s or 0.0) + held.service_s
        return self._shed(held, reason, now_s, retry_s, predicted, ahead, wait_s)

    def _shed(self, held: _Held, reason: ShedReason, now_s: float, retry_after_s: float,
              predicted_ttft_s: float | None = None, tokens_ahead: float = 0.0,
              queue_drain_s: float | None = None) -> Shed:
        self._give_back(held, now_s)
        band = self.band_name(held.request)
        self.counters.shed[held.request.tenant, band, reason] += 1
        return Shed(held.request, reason, max(0.0, retry_after_s), band, held.borrowing, predicted_ttft_s,
                    tokens_ahead, queue_drain_s)

    def _give_back(self, held: _Held, now_s: float) -> None:
        if held.quota_taken:
            self.buckets[held.request.tenant].give_back(held.quota_taken, now_s)
