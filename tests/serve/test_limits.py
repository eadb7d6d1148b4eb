"""Big bodies cost their sender, not everyone: a chunked upload stops at the limit, and a huge prompt
is refused or tokenized without stalling other clients."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse

from tests.serve.conftest import Client, ensure_app

MODEL = "builtin:tiny-llama"


def _chunked_upload(url: str, num_bytes: int, results: dict) -> None:
    """POST ``num_bytes`` of JSON with chunked framing; the status, or how the connection ended."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)

    def body():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        chunk = b"x" * (1 << 20)
        for _ in range(num_bytes >> 20):
            yield chunk
        yield b'"}'

    try:
        conn.request("POST", "/v1/completions", body=body(), encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        response = conn.getresponse()
        results["status"] = response.status
        results["body"] = response.read()[:300]
    except (BrokenPipeError, ConnectionResetError) as exc:  # the server stopped reading and closed
        results["status"] = type(exc).__name__
    finally:
        conn.close()


def test_huge_bodies_never_stall_other_clients(default_app):
    client = default_app
    assert client.request("GET", "/health")[0] == 200
    done = threading.Event()
    slowest: list[float] = []

    def probe_once() -> float:
        started = time.monotonic()
        assert client.request("GET", "/health")[0] == 200
        status, _ = client.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert status == 200
        return time.monotonic() - started

    def probe() -> None:
        while not done.is_set():
            slowest.append(probe_once())

    # The probe's own time on this host as it is now, before the big bodies: a stall is measured against it,
    # so that a host that is busy with other work slows both and fails neither.
    quiet = max(probe_once() for _ in range(5))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        upload: dict = {}
        _chunked_upload(client.url, 64 << 20, upload)
        big_prompt = {"model": MODEL, "prompt": "word " * 800_000, "max_tokens": 1}  # 4 MB, a legal body
        status, body = client.post("/v1/completions", big_prompt)
    finally:
        done.set()
        prober.join(60)
    assert upload["status"] in (413, "BrokenPipeError", "ConnectionResetError"), upload
    if upload["status"] == 413:
        assert b"request_too_large" in upload["body"]
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    # Stalled behind the 64 MiB upload or the 4 MB prompt's tokenizing, a probe would wait seconds.
    assert slowest and max(slowest) < max(1.0, 4 * quiet), (max(slowest), quiet)


def test_a_prompt_longer_than_the_kv_pool_holds_is_a_400_that_harms_no_later_request(ray_cluster):
    # 8 MiB of tiny-llama KV holds 2,048 tokens, under its max_model_len of 4,096: the engines refuse a
    # 3,000-token prompt. Refused as it stands, it is the client's error, answered once; before, each
    # prefill replica's refusal counted as a replica's failure, two of them sent every long prompt to the
    # decode replica for a cool-down, and the decode replica's refusal was a 500.
    ensure_app("default.yaml", engine={"model": MODEL, "kv_cache_bytes": 8 * 1024**2})
    client = Client(ray_cluster["url"])
    too_long = [3 + i % 1000 for i in range(3000)]
    # Long prompts, refused by the prefill replica; a short one whose max_tokens the pool cannot hold, by
    # the decode replica it prefills on.
    for prompt, fields in ((too_long, {"max_tokens": 0, "echo": True, "logprobs": 1}), (too_long, {"max_tokens": 4}),
                           (list(range(3, 40)), {"max_tokens": 3000})):
        status, body = client.post("/v1/completions", {"model": MODEL, "prompt": prompt, **fields})
        assert status == 400 and "KV blocks" in body["error"]["message"], body
        assert body["error"]["type"] == "invalid_request_error"
    status, body = client.post("/v1/completions", {"model": MODEL, "prompt": list(range(3, 400)), "max_tokens": 2})
    assert status == 200, body
    status, text = client.request("GET", f"/debug/requests/{body['id']}")
    routes = [span for span in json.loads(text)["spans"] if span["name"] == "route"]
    assert routes[0]["attributes"]["prefill"] == "remote"  # the prefill pool is not cooling down
