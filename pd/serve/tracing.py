"""Request traces in OpenTelemetry: each finished request's timeline, exported as one span tree over OTLP.

Off by default. With ``otlp_traces_endpoint`` set (as vLLM's
``--otlp-traces-endpoint``), the ingress turns each request's timeline
(``pd.serve.timeline``) into spans when the request ends: a root span
``pd.request`` for the whole request, a child for each of its steps
(``tokenize``, ``route``, each ``prefill`` and ``decode`` call), and under a
call the intervals its engine measured (``prefill.queue``,
``decode.kv_pull``, ...), each at the times the timeline recorded. A client's
W3C ``traceparent`` header makes the root a child of the client's span, so
the request joins the client's trace. The spans go out through the SDK's
batch processor, off the request's path; with tracing off nothing is built.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

from pd.serve.timeline import Timeline

logger = logging.getLogger(__name__)

SERVICE_NAME = "pd"
ROOT_SPAN = "pd.request"
EXPORT_DELAY_MS = 1000  # the batch processor's longest wait before it sends what it holds


def tracer_provider(endpoint: str | None, exporter=None):
    """A tracer provider exporting to ``endpoint`` (OTLP over HTTP) or to ``exporter``; None when neither is set."""
    if endpoint is None and exporter is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
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
    """Exports finished timelines as span trees through ``provider``."""

    def __init__(self, provider):
        self.provider = provider
        self.tracer = provider.get_tracer("pd.serve")

    def export(self, timeline: Timeline, parent=None) -> None:
        """``timeline`` as spans: the root over the whole request, its steps, and each call's engine intervals."""
        from opentelemetry import trace

        base_ns = time.time_ns() - int(timeline.now_s() * 1e9)  # the wall clock at the request's arrival
        end_s = timeline.finished_s if timeline.finished_s is not None else timeline.now_s()
        root = self.tracer.start_span(ROOT_SPAN, context=parent, start_time=base_ns,
                                      attributes={"pd.request_id": timeline.request_id,
                                                  "pd.status": timeline.status,
                                                  **{f"pd.{k}": v for k, v in timeline.attributes.items()}})
        calls: dict[str, object] = {}  # the latest call span by its name ("prefill", "decode")
        for span in timeline.spans:
            head = span.name.split(".", 1)[0]
            parent_span = calls.get(head, root) if "." in span.name else root
            otel = self.tracer.start_span(
                span.name, context=trace.set_span_in_context(parent_span), start_time=base_ns + _ns(span.start_s),
                attributes={f"pd.{k}": v for k, v in span.attributes.items()})
            if "error" in span.attributes:
                otel.set_status(trace.Status(trace.StatusCode.ERROR, str(span.attributes["error"])))
            otel.end(end_time=base_ns + _ns(span.end_s if span.end_s is not None else end_s))
            if "." not in span.name:
                calls[span.name] = otel
        if timeline.status in ("error", "timeout"):
            root.set_status(trace.Status(trace.StatusCode.ERROR, str(timeline.attributes.get("error", ""))))
        root.end(end_time=base_ns + _ns(end_s))

    def shutdown(self) -> None:
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
