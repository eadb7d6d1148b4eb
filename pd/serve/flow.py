"""Flow control in the ingress: ``router.flow_control.FlowController`` before any call to the pools.

    classify (400) ──> decide ──> Admit ──────────────────────────> the pools, at the admitted level's priority
                         │  └───> Shed ──> 429 + Retry-After, the reason in the body and the timeline
                         └──────> Wait ──> a future the watcher resolves (Admit or Shed)

One event loop drives it, as ``router.flow_control`` asks: the endpoints
(``admit``), each admitted request's end (``FlowTicket.release``) and a
watcher task that, every ``WATCH_S``, hands the controller each replica's
new routing report (``RoutingStats.seq`` tells a new one from the last one
again, so a replica that stopped reporting grows stale) and the replicas
gone, and polls: a waiting request is admitted as soon as a report or a
finished request makes room, and shed as soon as it can no longer make its
deadline. The reports reach the ingress through its routers
(``router.shared.PoolRouting.reports``), which Serve updates whenever a
replica's report changes, whether or not anything is routed.

The prediction a request is judged by is the routers' for the pool that
will compute its prompt: the prefill pool's where the remote-prefill rule
sends it there, the decode pool's otherwise (``PoolPredictions.best``); none
while that pool's router has no predictor (the prefix router) or no data.

An admitted request holds its place until ``FlowTicket.release``, which its
events' wrapper calls however they end; a response that never started its
body releases it when the wrapper is collected.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from typing import AsyncIterator, Callable, Mapping

from ray.util import metrics

from pd.serve.metrics import LATENCY_BOUNDARIES
from pd.serve.openai_protocol import OpenAIError
from pd.serve.timeline import Timeline
from router.flow_capacity import ReplicaReport
from router.flow_config import SLO_TTFT_HEADER, TENANT_HEADER, FlowConfig, FlowIdentity, FlowRequestError
from router.flow_control import Admit, FlowController, Shed, Wait
from router.latency import Prediction
from router.protocol import RouteHints

logger = logging.getLogger(__name__)

WATCH_S = 0.1  # how often the watcher reads the pools' reports and polls the queue


def identity_of(headers: Mapping[str, str], priority: int | None) -> FlowIdentity:
    """Who sent a request and how urgent it says it is: its bearer key, tenant and deadline headers, priority."""
    auth = headers.get("authorization", "")
    key = auth[7:] if auth.lower().startswith("bearer ") else None
    return FlowIdentity(key or None, headers.get(TENANT_HEADER), headers.get(SLO_TTFT_HEADER), priority)


def shed_error(shed: Shed) -> OpenAIError:
    """429 naming the reason (``code``), with ``Retry-After`` in whole seconds, at least 1."""
    retry = max(1, math.ceil(shed.retry_after_s))
    return OpenAIError(429, f"request shed: {shed.message()}", type="rate_limit_error", code=shed.reason.value,
                       headers={"Retry-After": str(retry)})


class FlowMetrics:
    """What flow control decided, per tenant and band (and reason), as Prometheus metrics."""

    def __init__(self) -> None:
        keys = ("tenant", "band")
        self.admitted = metrics.Counter("pd_flow_admitted_total", tag_keys=(*keys, "borrowing"),
                                        description="requests flow control admitted (borrowing: over its quota)")
        self.shed = metrics.Counter("pd_flow_shed_total", tag_keys=(*keys, "reason"),
                                    description="requests flow control answered with 429, by reason")
        self.waited = metrics.Histogram("pd_flow_wait_seconds", boundaries=LATENCY_BOUNDARIES, tag_keys=keys,
                                        description="time admitted requests waited in flow control's queue")
        self.waiting = metrics.Gauge("pd_flow_waiting_requests", description="requests waiting in flow control")
        self.in_flight = metrics.Gauge("pd_flow_in_flight_requests",
                                       description="requests flow control admitted that have not ended")


class FlowTicket:
    """An admitted request's place, released once however it ends (module docstring)."""

    def __init__(self, flow: "IngressFlow", request_id: str, level: int, waited_s: float = 0.0) -> None:
        self.flow = flow
        self.request_id = request_id
        self.level = level  # the engines' scheduling priority: its band's index, below every band when borrowing
        self.waited_s = waited_s  # in flow control's queue: spent from the request's timeout
        self.released = False

    def release(self, num_output_tokens: int) -> None:
        if not self.released:
            self.released = True
            self.flow.finished(self.request_id, num_output_tokens)

    def track(self, events: AsyncIterator) -> AsyncIterator:
        """``events`` (``(choice index, GenerationEvent)`` pairs), releasing the place when they end."""
        tracked = self._track(events)
        loop = asyncio.get_running_loop()
        weakref.finalize(tracked, _release_soon, loop, self)  # never iterated: released when collected
        return tracked

    async def _track(self, events: AsyncIterator) -> AsyncIterator:
        outputs: dict[int, int] = {}
        try:
            async for index, event in events:
                outputs[index] = event.num_output_tokens
                yield index, event
        finally:
            self.release(sum(outputs.values()))


def _release_soon(loop: asyncio.AbstractEventLoop, ticket: FlowTicket) -> None:
    try:
        loop.call_soon_threadsafe(ticket.release, 0)
    except RuntimeError:  # the loop is closed: the ingress is gone with its controller
        pass


class IngressFlow:
    """The ingress's flow control (module docstring). ``pools``: its ``PoolClient``; ``clock``: monotonic."""

    def __init__(self, config: FlowConfig, num_ingress: int, pools, clock: Callable[[], float] = time.monotonic):
        self.controller = FlowController(config, num_ingress=num_ingress)
        self.pools = pools
        self.clock = clock
        self.routings = {"prefill": pools.prefill_routing, "decode": pools.decode_routing}
        self.metrics = FlowMetrics()
        self._waiters: dict[str, asyncio.Future] = {}
        self._seen: dict[tuple[str, str], int] = {}  # (pool, replica) -> the report number last observed
        self._watcher: asyncio.Task | None = None

    async def admit(self, request_id: str, identity: FlowIdentity, hints: RouteHints, max_output_tokens: int,
                    timeline: Timeline, timeout_s: float | None = None, scores_prompt: bool = False) -> FlowTicket:
        """Admit the request, after waiting if it must; ``OpenAIError`` 400 (unclassifiable), 429 (shed) or 504
        (still waiting after ``timeout_s``, the request's own timeout). ``scores_prompt``: it computes its whole
        prompt (``echo`` with ``logprobs``, ``prompt_logprobs``), and is predicted so."""
        self._start()
        now = self.clock()
        self.refresh(now)
        try:
            request = self.controller.classify(request_id, identity, hints.num_prompt_tokens, max_output_tokens,
                                               now)
        except FlowRequestError as exc:
            raise OpenAIError(400, str(exc), param=exc.field) from None
        timeline.set(tenant=request.tenant, band=self.controller.band_name(request))
        outcome = self.controller.decide(request, self._prediction(hints, now, scores_prompt), now)
        if isinstance(outcome, Wait):
            outcome = await self._wait(outcome, timeline, timeout_s)
        else:
            self._count(outcome)
            self.poll()
        if isinstance(outcome, Shed):
            timeline.set(shed=outcome.reason.value, retry_after_s=round(outcome.retry_after_s, 3),
                         predicted_ttft_s=outcome.predicted_ttft_s, tokens_ahead=round(outcome.tokens_ahead),
                         queue_drain_s=outcome.queue_drain_s)
            raise shed_error(outcome)
        timeline.set(borrowing=outcome.borrowing or None, flow_level=outcome.level)
        return FlowTicket(self, request_id, outcome.level, self.clock() - now)

    async def _wait(self, wait: Wait, timeline: Timeline, timeout_s: float | None) -> Admit | Shed:
        request_id = wait.request.request_id
        future = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        self.poll()
        try:
            with timeline.span("flow.wait", predicted_wait_s=wait.predicted_wait_s):
                return await asyncio.wait_for(future, timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError) as exc:  # the client left, or its timeout passed
            self._waiters.pop(request_id, None)
            if not self.controller.cancel(request_id, self.clock()) and future.done() and not future.cancelled() \
                    and isinstance(future.result(), Admit):
                self.finished(request_id, 0)  # admitted just as it left: its place frees again
            if isinstance(exc, asyncio.TimeoutError):
                raise OpenAIError(504, f"request timed out after {timeout_s:g} s waiting in flow control's queue",
                                  type="timeout_error", code="request_timeout") from None
            raise

    def finished(self, request_id: str, num_output_tokens: int) -> None:
        """An admitted request ended: its place frees, and whoever waits for one may go."""
        self.controller.finished(request_id, num_output_tokens, self.clock())
        self.poll()

    def refresh(self, now_s: float) -> None:
        """Each replica's report not yet observed, and the replicas gone, to the controller."""
        for pool, routing in self.routings.items():
            reports = routing.reports
            for gone in [key for key in self._seen if key[0] == pool and key[1] not in reports]:
                del self._seen[gone]
                self.controller.forget(pool, gone[1])
            for replica_id, stats in reports.items():
                if self._seen.get((pool, replica_id)) == stats.seq:
                    continue
                self._seen[pool, replica_id] = stats.seq
                report = ReplicaReport.of(stats, routing.backlog_s(replica_id, now_s),
                                          routing.decode_step_s(replica_id, stats))
                self.controller.observe(pool, replica_id, report, now_s)

    def poll(self) -> None:
        """Hand out what the controller decided for waiting requests."""
        for outcome in self.controller.poll(self.clock()):
            request = outcome.request
            self._count(outcome)
            future = self._waiters.pop(request.request_id, None)
            if future is not None and not future.done():
                future.set_result(outcome)
            elif isinstance(outcome, Admit):  # its client left as it was admitted: the place frees again
                self.controller.finished(request.request_id, 0, self.clock())
        self.metrics.waiting.set(self.controller.num_waiting)
        self.metrics.in_flight.set(self.controller.num_in_flight)

    def _count(self, outcome: Admit | Shed) -> None:
        tags = {"tenant": outcome.request.tenant, "band": outcome.band}
        if isinstance(outcome, Admit):
            self.metrics.admitted.inc(tags={**tags, "borrowing": str(outcome.borrowing).lower()})
            self.metrics.waited.observe(outcome.waited_s, tags=tags)
        else:
            self.metrics.shed.inc(tags={**tags, "reason": outcome.reason.value})

    def _prediction(self, hints: RouteHints, now_s: float, scores_prompt: bool) -> Prediction | None:
        remote = self.pools.wants_remote_prefill(hints, scores_prompt)
        if scores_prompt:  # no cached block holds a prompt position's scores
            hints = hints.replace(block_hashes=())
        predictions = self.routings["prefill" if remote else "decode"].predictions()
        return None if predictions is None else predictions.best(hints.block_hashes, hints.num_prompt_tokens, now_s)

    def _start(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                now = self.clock()
                self.refresh(now)
                self.poll()
                wake = self.controller.next_wake_s()
                delay = WATCH_S if wake is None else min(WATCH_S, max(0.0, wake - now))
            except Exception:  # noqa: BLE001 - a bad report must not stop admission; said, then tried again
                logger.exception("flow control's watcher failed; retrying")
                delay = WATCH_S
            await asyncio.sleep(delay)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    def stats(self) -> dict:
        """For ``process_stats``: what is waiting and in flight, the pools the reports say are full or stale
        now (why requests wait), and the counters so far."""
        counters, capacity, now_s = self.controller.counters, self.controller.capacity, self.clock()
        return {"waiting": self.controller.num_waiting, "in_flight": self.controller.num_in_flight,
                "limit": capacity.limit, "full_pools": capacity.full_pools(now_s),
                "stale_pools": capacity.stale_pools(now_s),
                "admitted": {f"{t}/{b}": n for (t, b), n in counters.admitted.items()},
                "shed": {f"{t}/{b}/{r.value}": n for (t, b, r), n in counters.shed.items()},
                "served_tokens": dict(counters.served_tokens), "dispatched_tokens": counters.dispatched_tokens}
