"""Request traces (``pd.serve.tracing``): a timeline becomes one span tree, under the client's ``traceparent``."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pd.serve.protocol import RequestTimings
from pd.serve.timeline import Timeline, place_engine_timings
from pd.serve.tracing import ROOT_SPAN, RequestTracer, client_context, tracer_provider
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
