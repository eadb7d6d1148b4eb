"""Request traces (``pd.serve.tracing``): one span tree per request, under the client's ``traceparent``, across the
ingress and the replicas its calls reached."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pd.engine.timings import EngineTimings
from pd.sampling_params import SamplingParams
from pd.serve.protocol import PoolRequest, RequestTimings
from pd.serve.timeline import Timeline, place_engine_timings
from pd.serve.tracing import ROOT_SPAN, EngineTracer, RequestTracer, client_context, tracer_provider
from tests.serve.test_timeline import FakeClock

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _request(clock: FakeClock) -> Timeline:
    timeline = Timeline("cmpl-1", clock=clock, endpoint="/v1/completions")
    with timeline.span("route") as route:
        clock.now += 0.01
        route.set(prefill="remote")
    with timeline.span("prefill") as prefill:
        clock.now += 0.5
        prefill.set(replica="p1")
    place_engine_timings(timeline, "prefill", RequestTimings(queue_s=0.1, first_token_s=0.3), end_s=prefill.end_s)
    with timeline.span("decode") as decode:
        clock.now += 1.0
        decode.set(replica="d1", finish_reason="length")
    place_engine_timings(timeline, "decode", RequestTimings(queue_s=0.0, first_token_s=0.2, pull_s=0.1,
                                                            num_pulled_bytes=10**8, num_pulled_blocks=4),
                         end_s=decode.start_s + 0.3)
    timeline.finish("ok", num_output_tokens=8)
    return timeline


def test_a_timeline_is_one_tree_under_the_clients_span():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(tracer_provider(None, exporter))
    parent = client_context({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    tracer.export(_request(FakeClock()), parent)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {ROOT_SPAN, "route", "prefill", "prefill.queue", "prefill.compute", "decode",
                          "decode.queue", "decode.kv_pull", "decode.compute"}
    root = spans[ROOT_SPAN]
    assert {span.context.trace_id for span in spans.values()} == {int(TRACE_ID, 16)}
    assert root.parent.span_id == int(CLIENT_SPAN, 16)
    for name in ("route", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
    for name, call in (("prefill.queue", "prefill"), ("prefill.compute", "prefill"), ("decode.kv_pull", "decode")):
        assert spans[name].parent.span_id == spans[call].context.span_id
    assert spans["decode.kv_pull"].attributes["pd.bytes"] == 10**8
    assert spans["prefill"].attributes["pd.replica"] == "p1"
    assert root.attributes["pd.num_output_tokens"] == 8 and root.attributes["pd.request_id"] == "cmpl-1"
    # Times are the timeline's: the root covers 1.51 s, the prefill call 0.5 s of it.
    assert round((root.end_time - root.start_time) / 1e9, 3) == 1.51
    assert round((spans["prefill"].end_time - spans["prefill"].start_time) / 1e9, 3) == 0.5
    assert spans["prefill.compute"].end_time == spans["prefill"].end_time


def test_without_a_traceparent_the_root_starts_a_trace_and_an_error_is_marked():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(tracer_provider(None, exporter))
    clock = FakeClock()
    timeline = Timeline("cmpl-2", clock=clock)
    timeline.finish("error", http_status=400, error="bad stop")
    tracer.export(timeline, client_context({}))
    [root] = exporter.get_finished_spans()
    assert root.parent is None and root.status.status_code.name == "ERROR"


def test_tracing_off_builds_nothing():
    assert tracer_provider(None) is None


def _engine_tracer(exporter, role: str, replica: str) -> EngineTracer:
    """A replica's tracer: its own provider, as in its own process."""
    return EngineTracer(tracer_provider(None, exporter, **{"service.instance.id": replica, "pd.role": role}), role,
                        "nixl")


def test_calls_carry_their_span_to_the_replicas_whose_spans_join_the_tree():
    """The ingress's call spans go out as ``traceparent``s; each replica's spans land under its call's span."""
    ingress_spans, prefill_spans, decode_spans = InMemorySpanExporter(), InMemorySpanExporter(), InMemorySpanExporter()
    tracer = RequestTracer(tracer_provider(None, ingress_spans))
    prefill, decode = _engine_tracer(prefill_spans, "prefill", "p1"), _engine_tracer(decode_spans, "decode", "d1")
    timeline = Timeline("cmpl-3")
    tracer.begin(timeline, client_context({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}))
    with timeline.span("route"):
        pass
    with timeline.span("prefill") as call:
        traceparent = timeline.traceparent(call)
        request = PoolRequest(request_id="cmpl-3-p0", token_ids=(1, 2, 3), sampling=SamplingParams(),
                              traceparent=traceparent)
        now = time.time_ns()
        timings = EngineTimings(queue_s=0.001, first_token_s=0.002, num_cached_tokens=1, num_prompt_chunks=2)
        prefill.record(PoolRequest.decode(request.encode()).traceparent, now - 5_000_000, now - 4_000_000, timings,
                       replica="p1", num_cached_tokens=1)
    place_engine_timings(timeline, "prefill", RequestTimings.of(timings), end_s=call.end_s)
    with timeline.span("decode") as call:
        now = time.time_ns()
        pulled = EngineTimings(queue_s=0.0, first_token_s=0.003, pull_s=0.001, num_pulled_bytes=10**6,
                               num_pulled_blocks=4, num_pull_descriptors=1)
        decode.record(timeline.traceparent(call), now - 9_000_000, now - 8_000_000, pulled, num_output_tokens=5)
    place_engine_timings(timeline, "decode", RequestTimings.of(pulled), end_s=call.end_s)
    timeline.finish("ok")

    ingress = {span.name: span for span in ingress_spans.get_finished_spans()}
    assert set(ingress) == {ROOT_SPAN, "route", "prefill", "decode"}  # the engines' intervals are theirs to export
    assert {span["name"] for span in timeline.as_dict()["spans"]} >= {"prefill.queue", "decode.kv_pull"}  # /debug
    replicas = {span.name: span for span in [*prefill_spans.get_finished_spans(), *decode_spans.get_finished_spans()]}
    assert set(replicas) == {"prefill.engine", "prefill.queue", "prefill.compute", "decode.engine", "decode.queue",
                             "decode.kv_pull", "decode.compute", "decode.generate"}
    every = [*ingress.values(), *replicas.values()]
    assert {span.context.trace_id for span in every} == {int(TRACE_ID, 16)}
    assert ingress[ROOT_SPAN].parent.span_id == int(CLIENT_SPAN, 16)
    for role in ("prefill", "decode"):
        call, engine = ingress[role], replicas[f"{role}.engine"]
        assert call.parent.span_id == ingress[ROOT_SPAN].context.span_id and call.kind.name == "CLIENT"
        assert engine.parent.span_id == call.context.span_id and engine.kind.name == "SERVER"
        assert engine.resource.attributes["pd.role"] == role
        assert ingress[ROOT_SPAN].start_time <= call.start_time <= call.end_time <= ingress[ROOT_SPAN].end_time
    for name in ("decode.queue", "decode.kv_pull", "decode.compute", "decode.generate"):
        assert replicas[name].parent.span_id == replicas["decode.engine"].context.span_id, name
    pull = replicas["decode.kv_pull"].attributes
    assert (pull["pd.bytes"], pull["pd.blocks"], pull["pd.descriptors"], pull["pd.gb_per_s"]) == (10**6, 4, 1, 1.0)
    assert pull["pd.backend"] == "nixl" and replicas["prefill.compute"].attributes["pd.chunks"] == 2
    assert replicas["decode.engine"].attributes["pd.num_output_tokens"] == 5
    assert replicas["prefill.engine"].resource.attributes["service.instance.id"] == "p1"


def test_a_failed_pull_and_a_failed_call_are_marked_on_the_replicas_spans():
    exporter = InMemorySpanExporter()
    now = time.time_ns()
    failed = EngineTimings(queue_s=0.0, first_token_s=0.004, pull_s=0.002, pull_error="timed out")
    _engine_tracer(exporter, "decode", "d1").record(f"00-{TRACE_ID}-{CLIENT_SPAN}-01", now - 10**7, now - 10**7,
                                                    failed, "cancelled or aborted")
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert spans["decode.kv_pull"].status.status_code.name == "ERROR"
    assert spans["decode.kv_pull"].attributes["pd.error"] == "timed out"
    assert spans["decode.engine"].status.status_code.name == "ERROR"
    assert spans["decode.engine"].parent.span_id == int(CLIENT_SPAN, 16)


@pytest.mark.parametrize("value", ["junk", f"00-{TRACE_ID}-{CLIENT_SPAN}", f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01",
                                   "x" * 10_000])
def test_a_pool_request_refuses_a_traceparent_that_is_not_w3c(value):
    with pytest.raises(ValueError, match="traceparent must be a W3C trace context"):
        PoolRequest(request_id="r", token_ids=(1,), sampling=SamplingParams(), traceparent=value)
