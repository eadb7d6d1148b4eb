"""Request timelines and their ring (``pd.serve.timeline``), and the ``x-request-id`` middleware."""

from __future__ import annotations

import asyncio

import pytest

from pd.serve.protocol import RequestTimings
from pd.serve.request_id import MAX_CLIENT_ID_CHARS, RequestIds
from pd.serve.timeline import MAX_ATTRIBUTE_CHARS, MAX_SPANS, RequestRing, Timeline, place_engine_timings


class FakeClock:
    """Monotonic seconds that a test advances: spans get exact times."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_spans_are_seconds_after_arrival_and_an_exception_is_named():
    clock = FakeClock()
    timeline = Timeline("r1", clock=clock, endpoint="/v1/completions")
    clock.now += 0.5
    with timeline.span("route", num_prompt_tokens=12) as span:
        clock.now += 0.25
        span.set(prefill="local", ignored=None)
    with pytest.raises(RuntimeError), timeline.span("decode"):
        clock.now += 1.0
        raise RuntimeError("replica lost")
    timeline.finish("error", http_status=500)
    timeline.finish("ok")  # only the first end counts
    record = timeline.as_dict()
    assert record["status"] == "error" and record["duration_s"] == 1.75
    route, decode = record["spans"]
    assert (route["start_s"], route["end_s"], route["duration_s"]) == (0.5, 0.75, 0.25)
    assert route["attributes"] == {"num_prompt_tokens": 12, "prefill": "local"}
    assert decode["attributes"]["error"] == "RuntimeError: replica lost" and decode["duration_s"] == 1.0
    assert record["attributes"] == {"endpoint": "/v1/completions", "http_status": 500}


def test_a_span_still_open_when_the_request_ends_ends_with_it():
    clock = FakeClock()
    timeline = Timeline("r1", clock=clock)
    timeline.begin("decode")
    clock.now += 2.0
    timeline.finish("cancelled")
    assert timeline.as_dict()["spans"][0]["end_s"] == 2.0


def test_a_timeline_keeps_at_most_max_spans_and_counts_the_rest():
    timeline = Timeline("r1")
    for i in range(MAX_SPANS + 5):
        timeline.begin(f"s{i}")
    timeline.set(note="x" * (MAX_ATTRIBUTE_CHARS * 2))
    assert len(timeline.spans) == MAX_SPANS and timeline.num_dropped_spans == 5
    assert len(timeline.attributes["note"]) == MAX_ATTRIBUTE_CHARS


def test_engine_timings_are_placed_back_from_when_the_ingress_heard_of_them():
    clock = FakeClock()
    timeline = Timeline("r1", clock=clock)
    clock.now += 3.0
    timings = RequestTimings(queue_s=0.5, first_token_s=1.5, pull_s=1.0, num_pulled_bytes=2 * 10**9,
                             num_pulled_blocks=8)
    place_engine_timings(timeline, "decode", timings)
    spans = {span["name"]: span for span in timeline.as_dict()["spans"]}
    assert (spans["decode.queue"]["start_s"], spans["decode.queue"]["end_s"]) == (1.0, 1.5)
    assert (spans["decode.kv_pull"]["start_s"], spans["decode.kv_pull"]["end_s"]) == (1.5, 2.5)
    assert spans["decode.kv_pull"]["attributes"] == {"bytes": 2 * 10**9, "blocks": 8, "descriptors": 0, "gb_per_s": 2.0}
    assert (spans["decode.compute"]["start_s"], spans["decode.compute"]["end_s"]) == (2.5, 3.0)
    place_engine_timings(timeline, "decode", None)  # chunks after the first carry none
    assert len(timeline.spans) == 3


def test_request_timings_refuse_negative_or_nan_seconds():
    with pytest.raises(ValueError, match="queue_s"):
        RequestTimings(queue_s=-1.0, first_token_s=0.0)
    with pytest.raises(ValueError, match="pull_s"):
        RequestTimings(queue_s=0.0, first_token_s=0.0, pull_s=float("nan"))


def test_the_ring_keeps_the_newest_and_finds_them_by_either_id():
    ring = RequestRing(3)
    for i in range(5):
        ring.open(f"r{i}", x_request_id=f"client-{i}")
    assert len(ring) == 3
    assert ring.get("r1") is None and ring.get("client-1") is None  # evicted, alias too
    assert ring.get("r4").request_id == "r4" and ring.get("client-3").request_id == "r3"
    assert [t.request_id for t in ring.newest(2)] == ["r4", "r3"]
    assert len(ring._aliases) == 3


def test_a_client_id_reused_points_at_its_newest_request_and_survives_the_older_ones_eviction():
    ring = RequestRing(2)
    ring.open("a", x_request_id="same")
    ring.open("b", x_request_id="same")
    ring.open("c")  # evicts "a", whose alias now belongs to "b"
    assert ring.get("same").request_id == "b"


def test_a_ring_of_zero_keeps_nothing_and_a_negative_one_is_refused():
    ring = RequestRing(0)
    timeline = ring.open("r0")
    timeline.begin("route")
    assert len(ring) == 0 and ring.get("r0") is None
    with pytest.raises(ValueError, match="capacity"):
        RequestRing(-1)


def _call(app, headers: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers}
    asyncio.run(RequestIds(app)(scope, receive, send))
    return sent[0]["headers"], scope["state"]


async def _answer(scope, receive, send):
    """An app that answers with a stale header of its own."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"stale")]})
    await send({"type": "http.response.body", "body": b"{}"})


def test_an_id_on_the_request_is_adopted_and_left_to_the_proxy_that_put_it_there():
    """Serve's proxy puts the client's x-request-id (or its own) on the request and adds it to the response."""
    headers, state = _call(_answer, [(b"x-request-id", b"my-trace-7")])
    assert state["request_id"] == "my-trace-7" and state["request_id_from_proxy"]
    assert headers == [(b"x-request-id", b"stale")]  # the app's own, untouched: the proxy adds the id


@pytest.mark.parametrize("value", [b"", b"has\nnewline", b"x" * (MAX_CLIENT_ID_CHARS + 1), "é".encode()])
def test_an_id_that_cannot_be_echoed_is_replaced_by_ours(value):
    headers, state = _call(_answer, [(b"x-request-id", value)])
    assert state["request_id"].startswith("req-") and not state["request_id_from_proxy"]
    assert headers == [(b"x-request-id", state["request_id"].encode())]


def test_a_request_without_one_gets_a_generated_id_in_one_header():
    headers, state = _call(_answer, [])
    assert headers == [(b"x-request-id", state["request_id"].encode())]  # the stale one replaced
    assert state["request_id"].startswith("req-") and len(state["request_id"]) == 36
