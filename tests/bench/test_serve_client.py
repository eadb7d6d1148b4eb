"""bench.serve's streaming load (over ``loadtest.client``) against a real local HTTP server that sends chunked SSE."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from bench.serve import LoadResult, load, median_ratios, ratios, stream_one

GAP_S = 0.05


def _event(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"


# (seconds to wait before sending, chunk). Chunk boundaries fall inside an
# event's line and between two events, as a proxy may re-chunk a stream.
TOKEN_CHUNKS = [
    (GAP_S, _event("a")),
    (GAP_S, _event("b")[:12]),
    (GAP_S, _event("b")[12:]),
    (GAP_S, _event("c") + _event("d")),
    (0.0, ": a comment line\n\ndata: [DONE]\n\n"),
]
ERROR_CHUNKS = [(0.0, _event("a")), (0.0, 'data: {"error": {"message": "boom"}}\n\n')]
EMPTY_CHUNKS = [(0.0, "data: [DONE]\n\n")]


class _SSEHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked transfer encoding needs 1.1
    chunks: list[tuple[float, str]] = TOKEN_CHUNKS
    bodies: list[dict] = []

    def do_POST(self) -> None:
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for delay_s, chunk in self.chunks:
            time.sleep(delay_s)
            data = chunk.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def sse_server():
    """``serve(chunks)`` -> (base URL, request bodies received) of a server streaming ``chunks``."""
    servers = []

    def serve(chunks: list[tuple[float, str]]) -> tuple[str, list[dict]]:
        handler = type("Handler", (_SSEHandler,), {"chunks": chunks, "bodies": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}", handler.bodies

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_stream_one_stamps_each_event_through_chunked_framing(sse_server):
    url, bodies = sse_server(TOKEN_CHUNKS)
    with requests.Session() as session:
        ttft, gaps, text = stream_one(session, url, "hello", 4)
    assert text == "abcd"
    assert [(body["prompt"], body["max_tokens"], body["stream"], body["temperature"]) for body in bodies] == [
        ("hello", 4, True, 0.0)]
    assert ttft >= GAP_S
    assert len(gaps) == 3  # four token events; the comment and [DONE] are not tokens
    # b's line arrived in two chunks, GAP_S apart: it counts once, when complete (about 2 gaps after a,
    # where stamping it at its first chunk would give about 1). Thresholds sit between the two: a
    # loaded machine stamps a late, which shortens the measured gap below the server's sleeps.
    assert gaps[0] > 1.5 * GAP_S
    assert gaps[1] > 0.5 * GAP_S
    assert gaps[2] < gaps[1]  # d came in c's chunk


def test_stream_one_raises_on_an_error_event_or_an_empty_stream(sse_server):
    with requests.Session() as session:
        with pytest.raises(RuntimeError, match="boom"):
            stream_one(session, sse_server(ERROR_CHUNKS)[0], "hello", 4)
        with pytest.raises(RuntimeError, match="empty stream"):
            stream_one(session, sse_server(EMPTY_CHUNKS)[0], "hello", 4)


def test_load_streams_every_prompt_and_collects_every_ttft_and_gap(sse_server):
    url, bodies = sse_server(TOKEN_CHUNKS)
    result = load(url, ["a", "b", "c"], 4, concurrency=2)
    assert sorted(body["prompt"] for body in bodies) == ["a", "b", "c"]
    assert len(result.ttfts) == 3 and all(ttft >= GAP_S for ttft in result.ttfts)
    assert len(result.gaps) == 3 * 3
    assert sorted(result.texts) == [0, 1, 2] and result.wall_s > 0


def test_repeats_report_each_ratio_and_its_median():
    def result(ttft_s: float, wall_s: float) -> LoadResult:
        return LoadResult(ttfts=[ttft_s] * 4, gaps=[0.01] * 12, texts={0: "same", 1: "ours"}, wall_s=wall_s)

    def repeat(ours_wall_s: float) -> list[dict]:
        vllm = result(0.1, 1.0)
        vllm.texts = {0: "same", 1: "theirs"}
        return ratios({"colocated": result(0.15, ours_wall_s), "vllm": vllm}, max_tokens=8)

    per_repeat = [repeat(1.0), repeat(2.0), repeat(0.5)]
    assert [line["case"] for line in per_repeat[0]] == ["ratio_colocated_over_vllm"]
    assert per_repeat[0][0]["same_text"] == 0.5
    (median,) = median_ratios(per_repeat)
    assert median["median_of"] == 3
    assert median["output_tok_s_each"] == [1.0, 0.5, 2.0]
    assert median["output_tok_s"] == 1.0
    assert median["ttft_p50"] == 1.5
