"""Flow control in the ingress (``pd.serve.flow``): reports from the routers, waiting, 429s, places released.

The controller's own decisions are tested in ``tests/router/test_flow_control*``;
these drive ``IngressFlow`` as the ingress does, on a clock the test moves.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from pd.serve.flow import FlowTicket, IngressFlow, identity_of, shed_error
from pd.serve.openai_protocol import OpenAIError
from pd.serve.stream import GenerationEvent
from pd.serve.timeline import Timeline
from router.flow_config import Band, FlowConfig, FlowIdentity, SaturationConfig, Tenant, key_digest
from router.protocol import RouteHints, RoutingStats
from router.shared import PoolRouting

CONFIG = FlowConfig(bands=(Band("interactive", max_priority=0, ttft_deadline_s=2.0), Band("batch", min_priority=1)),
                    tenants=(Tenant("a"), Tenant("c", max_queued=1)), default_tenant="a",
                    saturation=SaturationConfig(max_waiting=2, max_report_age_s=3.0),
                    key_tenants={key_digest("sk-c"): "c"})


class Pools:
    """What ``IngressFlow`` reads of the ingress's ``PoolClient``: the pools' routing, and the remote rule."""

    def __init__(self) -> None:
        self.prefill_routing = PoolRouting()
        self.decode_routing = PoolRouting()
        self.asked: list[tuple[tuple[bytes, ...], bool]] = []

    def wants_remote_prefill(self, hints: RouteHints, scores_prompt: bool = False) -> bool:
        self.asked.append((hints.block_hashes, scores_prompt))
        return False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hints(request_id: str, tokens: int = 100) -> RouteHints:
    return RouteHints(request_id=request_id, num_prompt_tokens=tokens)


def event(num_output_tokens: int) -> GenerationEvent:
    return GenerationEvent([1], "x", [], None, 100, num_output_tokens)


def flow_with(waiting: int) -> tuple[IngressFlow, Pools, Clock]:
    pools, clock = Pools(), Clock()
    flow = IngressFlow(CONFIG, 1, pools, clock)
    pools.decode_routing.set_reports({"d0": RoutingStats(seq=1, num_waiting=waiting)})
    return flow, pools, clock


async def fill(flow: IngressFlow) -> FlowTicket:
    """The one request a full pool still takes (so that a finished request can always be followed)."""
    return await flow.admit("first", FlowIdentity(), hints("first"), 16, Timeline("first"))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_identity_reads_the_bearer_key_and_the_headers():
    identity = identity_of({"authorization": "Bearer sk-c", "x-tenant-id": "a", "x-slo-ttft-ms": "500"}, 3)
    assert identity == FlowIdentity("sk-c", "a", "500", 3)
    assert identity_of({}, None) == FlowIdentity()


def test_with_room_a_request_is_admitted_at_its_bands_level():
    async def run():
        flow, _, _ = flow_with(waiting=0)
        timeline = Timeline("r1")
        ticket = await flow.admit("r1", FlowIdentity(priority=5), hints("r1"), 16, timeline)
        assert ticket.level == 1 and flow.controller.num_in_flight == 1
        assert timeline.attributes["tenant"] == "a" and timeline.attributes["band"] == "batch"
        ticket.release(4)
        ticket.release(4)  # once only
        assert flow.controller.num_in_flight == 0 and flow.controller.counters.served_tokens["a"] == 104
        flow.close()

    asyncio.run(run())


def test_an_unclassifiable_request_is_a_400_naming_the_field():
    async def run():
        flow, _, _ = flow_with(waiting=0)
        with pytest.raises(OpenAIError) as refused:
            await flow.admit("r1", FlowIdentity(slo_ttft_header="soon"), hints("r1"), 16, Timeline("r1"))
        assert refused.value.status == 400 and refused.value.param == "x-slo-ttft-ms"
        flow.close()

    asyncio.run(run())


def test_a_full_pool_holds_requests_until_a_new_report_makes_room():
    async def run():
        flow, pools, clock = flow_with(waiting=5)  # over max_waiting: the pool is full
        await fill(flow)
        first = asyncio.ensure_future(flow.admit("r1", FlowIdentity(priority=1), hints("r1"), 16, Timeline("r1")))
        await settle()
        assert not first.done() and flow.controller.num_waiting == 1
        pools.decode_routing.set_reports({"d0": RoutingStats(seq=1, num_waiting=0)})  # the same report again
        flow.refresh(clock.now)
        flow.poll()
        await settle()
        assert not first.done()  # nothing new was heard
        clock.now += 0.5
        pools.decode_routing.set_reports({"d0": RoutingStats(seq=2, num_waiting=0)})
        flow.refresh(clock.now)
        flow.poll()
        ticket = await asyncio.wait_for(first, 1.0)
        assert isinstance(ticket, FlowTicket) and flow.controller.num_waiting == 0
        flow.close()

    asyncio.run(run())


def test_a_replica_that_stops_reporting_goes_stale_and_holds_requests():
    async def run():
        flow, pools, clock = flow_with(waiting=0)
        await flow.admit("r1", FlowIdentity(), hints("r1"), 16, Timeline("r1"))
        clock.now += 10.0  # past max_report_age_s with the same report
        waiting = asyncio.ensure_future(flow.admit("r2", FlowIdentity(), hints("r2"), 16, Timeline("r2")))
        await settle()
        assert not waiting.done()
        pools.decode_routing.set_reports({"d1": RoutingStats(seq=1)})  # replaced: d0 forgotten, d1 heard
        flow.refresh(clock.now)
        flow.poll()
        await asyncio.wait_for(waiting, 1.0)
        assert list(flow.controller.capacity._reports["decode"]) == ["d1"]
        flow.close()

    asyncio.run(run())


def test_shed_is_a_429_with_retry_after_and_the_reason_in_body_and_timeline():
    async def run():
        flow, _, _ = flow_with(waiting=5)
        await fill(flow)
        key = {"authorization": "Bearer sk-c"}
        queued = asyncio.ensure_future(flow.admit("c1", identity_of(key, 1), hints("c1"), 16, Timeline("c1")))
        await settle()
        timeline = Timeline("c2")
        with pytest.raises(OpenAIError) as shed:
            await flow.admit("c2", identity_of(key, 1), hints("c2"), 16, timeline)  # c's queue bound is 1
        error = shed.value
        assert error.status == 429 and error.code == "tenant_queue" and error.type == "rate_limit_error"
        assert int(error.headers["Retry-After"]) >= 1 and "tenant" in error.message
        assert timeline.attributes["shed"] == "tenant_queue" and timeline.attributes["tenant"] == "c"
        assert flow.controller.counters.shed  # counted per tenant, band and reason
        queued.cancel()
        await settle()
        assert flow.controller.num_waiting == 0  # the client that left is out of the queue
        flow.close()

    asyncio.run(run())


def test_a_request_still_waiting_at_its_timeout_is_a_504_and_leaves_the_queue():
    async def run():
        flow, _, _ = flow_with(waiting=5)
        await fill(flow)
        timeline = Timeline("r1")
        with pytest.raises(OpenAIError) as timed_out:
            await flow.admit("r1", FlowIdentity(), hints("r1"), 16, timeline, timeout_s=0.05)
        assert timed_out.value.status == 504 and "flow control" in timed_out.value.message
        assert flow.controller.num_waiting == 0 and flow.controller.counters.cancelled == {("a", "interactive"): 1}
        flow.close()

    asyncio.run(run())


def test_retry_after_is_whole_seconds_at_least_one():
    class Shed:
        retry_after_s = 2.2
        reason = type("R", (), {"value": "deadline"})()

        def message(self):
            return "late"

    assert shed_error(Shed()).headers == {"Retry-After": "3"}
    Shed.retry_after_s = 0.0
    assert shed_error(Shed()).headers == {"Retry-After": "1"}


def test_tracked_events_release_the_place_with_their_output_tokens_however_they_end():
    async def run():
        flow, _, _ = flow_with(waiting=0)

        async def events(fail: bool):
            yield 0, event(3)
            yield 1, event(2)
            if fail:
                raise RuntimeError("replica lost")

        ticket = await flow.admit("r1", FlowIdentity(), hints("r1"), 16, Timeline("r1"))
        assert [index async for index, _ in ticket.track(events(False))] == [0, 1]
        assert ticket.released and flow.controller.counters.served_tokens["a"] == 105
        ticket = await flow.admit("r2", FlowIdentity(), hints("r2"), 16, Timeline("r2"))
        with pytest.raises(RuntimeError):
            async for _ in ticket.track(events(True)):
                pass
        assert ticket.released and flow.controller.num_in_flight == 0
        ticket = await flow.admit("r3", FlowIdentity(), hints("r3"), 16, Timeline("r3"))
        tracked = ticket.track(events(False))  # a response whose body never started
        del tracked
        gc.collect()
        await settle()
        assert ticket.released and flow.controller.num_in_flight == 0
        flow.close()

    asyncio.run(run())


def test_a_request_scoring_its_prompt_is_predicted_as_computing_all_of_it():
    """``echo`` with ``logprobs`` and ``prompt_logprobs`` need every position's logits, which no cached block holds:
    the remote rule and the TTFT prediction behind a shed see the whole prompt uncached."""
    priced: list[tuple[bytes, ...]] = []
    held = (b"a" * 16, b"b" * 16)  # blocks a replica caches

    class Predictions:
        def best(self, block_hashes, num_prompt_tokens, now_s):
            priced.append(tuple(block_hashes))
            return None

    async def run():
        flow, pools, _ = flow_with(waiting=0)
        pools.decode_routing.predictions = Predictions
        cached = RouteHints(request_id="r", num_prompt_tokens=64, block_hashes=held)
        for request_id, scores in (("plain", False), ("scored", True)):
            ticket = await flow.admit(request_id, FlowIdentity(), cached.replace(request_id=request_id), 16,
                                      Timeline(request_id), scores_prompt=scores)
            ticket.release(0)
        flow.close()
        return pools.asked

    assert asyncio.run(run()) == [(held, False), (held, True)]  # the rule is told, and drops them itself
    assert priced == [held, ()]


def test_with_flow_control_the_pools_bound_batch_steps_unless_the_engine_says_otherwise():
    from pd.config.app import AppArgs
    from pd.config.flow_control import LOW_PRIORITY_STEP_S
    from tests.serve.conftest import config_args
    from tests.serve.test_configs import _with_flow_control

    def step_s(args: dict) -> float | None:
        return AppArgs.parse(AppArgs.parse(args).for_pools()).engine_config("prefill").low_priority_step_s

    assert step_s(_with_flow_control()) == LOW_PRIORITY_STEP_S
    assert step_s(config_args("default.yaml")) is None
    for given in (None, 0.5):  # set, even to None, it is the operator's
        args = _with_flow_control()
        assert step_s({**args, "engine": {**args["engine"], "low_priority_step_s": given}}) == given
