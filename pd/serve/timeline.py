"""One request's timeline as the ingress sees it, and the ring of the last requests' timelines.

A timeline is a list of spans, each a named interval in seconds after the
request reached the ingress, with a few attributes: the routing decision,
each prefill attempt, the decode stream, and what the engines measured on
their side (queue wait, compute, the KV pull). ``GET /debug/requests/{id}``
serves the timelines of the last ``debug_requests_kept`` requests from a
bounded ring, so a user's complaint that names a request id (the response's
``x-request-id``) leads to where its time went, with no tracing backend.

Both are bounded: a ring keeps at most its capacity, and a timeline at most
``MAX_SPANS`` spans (a stream that migrates many times counts the rest),
each attribute's text at most ``MAX_ATTRIBUTE_CHARS``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

logger = logging.getLogger(__name__)

MAX_SPANS = 64
MAX_ATTRIBUTE_CHARS = 256
Attribute = str | int | float | bool


def _attribute(value: object) -> Attribute:
    if isinstance(value, (bool, int, float)):
        return value
    return str(value)[:MAX_ATTRIBUTE_CHARS]


@dataclass
class Span:
    """A named interval; ``start_s`` and ``end_s`` are seconds after the request arrived."""

    name: str
    start_s: float
    end_s: float | None = None
    attributes: dict[str, Attribute] = field(default_factory=dict)
    measured_by_engine: bool = False  # placed from an engine's ``RequestTimings``

    def set(self, **attributes: object) -> None:
        self.attributes.update({key: _attribute(value) for key, value in attributes.items() if value is not None})

    def as_dict(self) -> dict:
        duration = None if self.end_s is None else round(self.end_s - self.start_s, 6)
        return {"name": self.name, "start_s": round(self.start_s, 6),
                "end_s": None if self.end_s is None else round(self.end_s, 6),
                "duration_s": duration, "attributes": dict(self.attributes)}


class Timeline:
    """The spans of one request, recorded by the ingress as they happen.

    ``clock`` is monotonic seconds; an engine's measured intervals arrive as
    durations and are placed with ``add_before``, ending where the ingress
    learned of them.
    """

    def __init__(self, request_id: str, *, clock=time.monotonic, wall=time.time, **attributes: object):
        self.request_id = request_id
        self._clock = clock
        self.arrived = clock()
        self.arrived_unix = wall()
        self.attributes: dict[str, Attribute] = {}
        self.status = "running"
        self.finished_s: float | None = None
        self.spans: list[Span] = []
        self.num_dropped_spans = 0
        self.tracing = None  # the request's open trace (``pd.serve.tracing``), ended with the request
        self.set(**attributes)

    def set(self, **attributes: object) -> None:
        self.attributes.update({key: _attribute(value) for key, value in attributes.items() if value is not None})

    def now_s(self) -> float:
        return self._clock() - self.arrived

    def _keep(self, span: Span) -> Span:
        if len(self.spans) < MAX_SPANS:
            self.spans.append(span)
        else:
            self.num_dropped_spans += 1
        return span

    def begin(self, name: str, **attributes: object) -> Span:
        span = Span(name, self.now_s())
        span.set(**attributes)
        return self._keep(span)

    def end(self, span: Span, **attributes: object) -> None:
        if span.end_s is None:
            span.end_s = self.now_s()
        span.set(**attributes)

    @contextmanager
    def span(self, name: str, **attributes: object) -> Iterator[Span]:
        """A span around a block; an exception leaving it is named in ``error``."""
        span = self.begin(name, **attributes)
        try:
            yield span
        except BaseException as exc:
            span.set(error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise
        finally:
            self.end(span)

    def traceparent(self, span: Span) -> str:
        """The W3C trace context of ``span``, a call about to go to a replica, when the request is traced; else ""."""
        return self.tracing.traceparent(span) if self.tracing is not None else ""

    def add_before(self, name: str, duration_s: float, end_s: float | None = None, *, by_engine: bool = False,
                   **attributes: object) -> Span:
        """A span measured elsewhere (by an engine: ``by_engine``): ``duration_s`` long, ending at ``end_s`` (or now)."""
        end = self.now_s() if end_s is None else end_s
        span = Span(name, max(0.0, end - max(0.0, duration_s)), end, measured_by_engine=by_engine)
        span.set(**attributes)
        return self._keep(span)

    def finish(self, status: str, **attributes: object) -> None:
        """The request's end (once): ``ok``, ``error``, ``cancelled`` or ``timeout``."""
        if self.finished_s is not None:
            return
        self.finished_s = self.now_s()
        self.status = status
        for span in self.spans:  # a span a cancellation cut short ends with the request
            if span.end_s is None:
                span.end_s = self.finished_s
        self.set(**attributes)
        if self.tracing is not None:
            try:
                self.tracing.finish(self)
            except Exception:  # noqa: BLE001 - a tracing failure never fails the request
                logger.exception("request %s: its trace could not be ended", self.request_id)

    def summary(self) -> dict:
        return {"request_id": self.request_id, "status": self.status, "arrived_unix": self.arrived_unix,
                "duration_s": round(self.finished_s if self.finished_s is not None else self.now_s(), 6)}

    def as_dict(self) -> dict:
        return {**self.summary(), "attributes": dict(self.attributes),
                "spans": [span.as_dict() for span in self.spans], "num_dropped_spans": self.num_dropped_spans}


class RequestRing:
    """The last ``capacity`` requests' timelines, by request id and by ``x-request-id`` (``pd.serve.request_id``).

    ``capacity`` 0 keeps none (``/debug/requests`` then finds nothing).
    """

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"a request ring's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()
        self._aliases: dict[str, str] = {}  # an x-request-id -> our request id (the newest request of that id)

    def __len__(self) -> int:
        return len(self._timelines)

    def open(self, request_id: str, x_request_id: str | None = None, **attributes: object) -> Timeline:
        timeline = Timeline(request_id, x_request_id=x_request_id, **attributes)
        if self.capacity == 0:
            return timeline
        self._timelines[request_id] = timeline
        if x_request_id:
            self._aliases[x_request_id] = request_id
        while len(self._timelines) > self.capacity:
            _, evicted = self._timelines.popitem(last=False)
            alias = evicted.attributes.get("x_request_id")
            if alias is not None and self._aliases.get(str(alias)) == evicted.request_id:
                del self._aliases[str(alias)]
        return timeline

    def newest(self, limit: int) -> list[Timeline]:
        """Up to ``limit`` timelines, the newest first."""
        return [timeline for _, timeline in zip(range(limit), reversed(self._timelines.values()))]

    def get(self, key: str) -> Timeline | None:
        """The timeline of request id ``key``, or of the newest request whose ``x-request-id`` is ``key``."""
        found = self._timelines.get(key)
        if found is None and key in self._aliases:
            found = self._timelines.get(self._aliases[key])
        return found


def place_engine_timings(timeline: Timeline, prefix: str, timings, end_s: float | None = None) -> None:
    """An engine's measured intervals (a ``RequestTimings``) as spans ending when the ingress heard of them.

    ``{prefix}.queue`` (arrival to admission), ``{prefix}.kv_pull`` (when
    there was one) and ``{prefix}.compute`` (the rest, to the first token).
    What lies before the queue span in the enclosing call is the calls' own
    time (Ray, routing, the network).
    """
    if timings is None:
        return
    end = timeline.now_s() if end_s is None else end_s
    admitted = end - timings.first_token_s
    timeline.add_before(f"{prefix}.queue", timings.queue_s, end_s=admitted, by_engine=True,
                        num_preemptions=timings.num_preemptions)
    compute_start = admitted
    if timings.pull_s > 0:
        timeline.add_before(f"{prefix}.kv_pull", timings.pull_s, end_s=admitted + timings.pull_s, by_engine=True,
                            **pull_attributes(timings))
        compute_start = admitted + timings.pull_s
    timeline.add_before(f"{prefix}.compute", end - compute_start, end_s=end, by_engine=True,
                        chunks=timings.num_prompt_chunks)


def pull_attributes(timings) -> dict[str, object]:
    """A KV pull's attributes from its ``RequestTimings`` or ``EngineTimings``: what moved, how fast, or why not."""
    rate = timings.num_pulled_bytes / timings.pull_s / 1e9 if timings.pull_s > 0 else 0.0
    attributes = {"bytes": timings.num_pulled_bytes, "blocks": timings.num_pulled_blocks,
                  "descriptors": timings.num_pull_descriptors, "gb_per_s": round(rate, 3)}
    if timings.pull_error:
        attributes["error"] = timings.pull_error
    return attributes
