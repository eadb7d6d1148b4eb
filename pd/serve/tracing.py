"""Request traces in OpenTelemetry: one span tree per request, across the ingress and the replicas it called.

Off by default. With ``otlp_traces_endpoint`` set (as vLLM's
``--otlp-traces-endpoint``), every process of the app exports spans over
OTLP/HTTP. The ingress opens a root span ``pd.request`` when a request
arrives, under the client's W3C ``traceparent`` when it sent one. Each call
to a replica opens a span (``prefill``, ``decode``) whose context travels in
the call's ``PoolRequest.traceparent``; the replica exports its own spans
under it (``EngineTracer``): ``prefill.engine`` or ``decode.engine`` around
its part, with what its engine measured inside (``*.queue``, ``decode.kv_pull``
with the bytes, descriptors and GB/s of the transfer, ``*.compute`` to its
first token, ``decode.generate`` after it). When the request ends the
ingress ends its spans, and turns the rest of its timeline
(``pd.serve.timeline``: ``tokenize``, ``route``, ...) into spans at the
times it recorded. Spans go out through the SDK's batch processor, off the
request's path; with tracing off nothing is built.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

from pd.engine.timings import EngineTimings
from pd.serve.timeline import Span, Timeline, pull_attributes

logger = logging.getLogger(__name__)

SERVICE_NAME = "pd"
ROOT_SPAN = "pd.request"
EXPORT_DELAY_MS = 1000  # the batch processor's longest wait before it sends what it holds


def tracer_provider(endpoint: str | None, exporter=None, **resource: str | int):
    """A tracer provider exporting to ``endpoint`` (OTLP over HTTP) or to ``exporter``; None when neither is set.

    ``resource`` names the process (``service.instance.id``: a replica's id,
    ``pd.role``), beside ``service.name`` "pd" and its pid.
    """
    if endpoint is None and exporter is None:
        return None
    import os

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME, "process.pid": os.getpid(),
                                                        **resource}))
    if exporter is not None:  # tests: the SDK's in-memory exporter, spans delivered at once
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                       schedule_delay_millis=EXPORT_DELAY_MS))
    return provider


def client_context(headers: Mapping[str, str]):
    """The OpenTelemetry context of the client's ``traceparent`` (and ``tracestate``); None without one."""
    if "traceparent" not in headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({k: headers[k] for k in ("traceparent", "tracestate")
                                                    if k in headers})


class RequestTracer:
    """The ingress's traces: each request's timeline as a span tree, its calls' spans opened as they are sent."""

    def __init__(self, provider):
        self.provider = provider
        self.tracer = provider.get_tracer("pd.serve")

    def begin(self, timeline: Timeline, parent=None) -> None:
        """Trace ``timeline`` from now, under ``parent`` (the client's context); it is exported when it finishes."""
        timeline.tracing = _RequestTrace(self.tracer, timeline, parent)

    def export(self, timeline: Timeline, parent=None) -> None:
        """A finished ``timeline`` that was not traced as it ran, as spans now."""
        _RequestTrace(self.tracer, timeline, parent).finish(timeline)

    def shutdown(self) -> None:
        self.provider.shutdown()


class _RequestTrace:
    """One request's root span, open from its arrival, and the spans of its calls to replicas."""

    def __init__(self, tracer, timeline: Timeline, parent):
        self.tracer = tracer
        self.base_ns = time.time_ns() - _ns(timeline.now_s())  # the wall clock at the request's arrival
        self.root = tracer.start_span(ROOT_SPAN, context=parent, start_time=self.base_ns)
        self.calls: dict[int, tuple[Span, object]] = {}  # id of a call's timeline span -> (it, its open span)

    def traceparent(self, span: Span) -> str:
        from opentelemetry import trace

        otel = self.tracer.start_span(span.name, context=trace.set_span_in_context(self.root),
                                      kind=trace.SpanKind.CLIENT, start_time=self.base_ns + _ns(span.start_s))
        self.calls[id(span)] = (span, otel)
        context = otel.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"

    def finish(self, timeline: Timeline) -> None:
        """End the spans: the calls' at the times recorded, the rest made from the timeline."""
        from opentelemetry import trace

        end_s = timeline.finished_s if timeline.finished_s is not None else timeline.now_s()
        self.root.set_attributes({"pd.request_id": timeline.request_id, "pd.status": timeline.status,
                                  **{f"pd.{k}": v for k, v in timeline.attributes.items()}})
        latest: dict[str, tuple[object, bool]] = {}  # a call's name -> its latest span, and whether it was sent one
        for span in timeline.spans:
            head = span.name.split(".", 1)[0]
            call, traced = latest.get(head, (self.root, False)) if "." in span.name else (self.root, False)
            if span.measured_by_engine and traced:
                continue  # that replica exported it, under the call's span
            live = self.calls.pop(id(span), None)
            otel = live[1] if live is not None else self.tracer.start_span(
                span.name, context=trace.set_span_in_context(call), start_time=self.base_ns + _ns(span.start_s))
            _end(otel, span, self.base_ns + _ns(span.end_s if span.end_s is not None else end_s))
            if "." not in span.name:
                latest[span.name] = (otel, live is not None)
        for span, otel in self.calls.values():  # calls beyond the timeline's bound
            _end(otel, span, self.base_ns + _ns(span.end_s if span.end_s is not None else end_s))
        if timeline.status in ("error", "timeout"):
            self.root.set_status(trace.Status(trace.StatusCode.ERROR, str(timeline.attributes.get("error", ""))))
        self.root.end(end_time=self.base_ns + _ns(end_s))


class EngineTracer:
    """A replica's spans of the calls it served, each under the calling span that its ``traceparent`` names."""

    def __init__(self, provider, role: str, backend: str = ""):
        self.provider = provider
        self.role = role
        self.backend = backend  # the KV transfer's ("nixl", "torch")
        self.tracer = provider.get_tracer("pd.engine")

    def record(self, traceparent: str, started_ns: int, arrived_ns: int, timings: EngineTimings | None,
               error: str = "", **attributes: object) -> None:
        """The call from ``started_ns`` to now, and what the engine measured from the request's arrival on.

        ``{role}.engine`` spans the call; inside it ``{role}.queue`` (arrival
        to admission), ``{role}.kv_pull`` (when there was one),
        ``{role}.compute`` (to the first token out of this engine) and, when
        tokens came after it, ``{role}.generate``.
        """
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ended_ns = time.time_ns()
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        call = self.tracer.start_span(f"{self.role}.engine", context=parent, kind=trace.SpanKind.SERVER,
                                      start_time=started_ns,
                                      attributes={f"pd.{k}": v for k, v in attributes.items() if v is not None})
        if timings is not None:
            inside = trace.set_span_in_context(call)
            admitted_ns = arrived_ns + _ns(timings.queue_s)
            first_token_ns = min(ended_ns, admitted_ns + _ns(timings.first_token_s))
            pieces = [("queue", arrived_ns, admitted_ns, {"num_preemptions": timings.num_preemptions})]
            compute_ns = admitted_ns
            if timings.pull_s > 0:
                compute_ns = admitted_ns + _ns(timings.pull_s)
                pulled = {**pull_attributes(timings), "backend": self.backend}
                pieces.append(("kv_pull", admitted_ns, compute_ns, pulled))
            pieces.append(("compute", compute_ns, first_token_ns, {"num_cached_tokens": timings.num_cached_tokens,
                                                                   "chunks": timings.num_prompt_chunks}))
            if ended_ns > first_token_ns and self.role == "decode":
                pieces.append(("generate", first_token_ns, ended_ns, {}))
            for name, start_ns, end_ns, values in pieces:
                span = self.tracer.start_span(f"{self.role}.{name}", context=inside, start_time=start_ns,
                                              attributes={f"pd.{k}": v for k, v in values.items()})
                if "error" in values:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, str(values["error"])))
                span.end(end_time=max(start_ns, end_ns))
        if error:
            call.set_status(trace.Status(trace.StatusCode.ERROR, error))
        call.end(end_time=ended_ns)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _end(otel, span: Span, end_ns: int) -> None:
    from opentelemetry import trace

    otel.set_attributes({f"pd.{k}": v for k, v in span.attributes.items()})
    if "error" in span.attributes:
        otel.set_status(trace.Status(trace.StatusCode.ERROR, str(span.attributes["error"])))
    otel.end(end_time=end_ns)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
