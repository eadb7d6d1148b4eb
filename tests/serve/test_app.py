"""The default app, for real: HTTP, both prefill paths, fallbacks, disconnects, the handle API."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

from pd import SamplingParams
from tests.serve.conftest import pool_stats, token_counts, wait_until

MODEL = "builtin:tiny-llama"
SHORT = "Tell me about the sea."
LONG = " ".join(f"word{i}" for i in range(150))  # well over the 256-token remote threshold


@pytest.fixture
def app(default_app):
    return default_app


def _totals(deployment: str, key: str) -> int:
    return sum(s[key] for s in pool_stats(deployment))


def _idle_and_clean() -> bool:
    decode, prefill = pool_stats("DecodeServer"), pool_stats("PrefillServer")
    return all(s["num_used_blocks"] == 0 and s["num_running"] == 0 for s in decode + prefill) and all(
        s["num_pinned_leases"] == 0 for s in prefill
    )


def test_models_and_health(app):
    status, body = app.request("GET", "/health")
    assert status == 200
    status, body = app.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["local-prefill", "remote-prefill"])
def test_completion_equals_offline_and_takes_the_expected_path(app, offline, prompt):
    pulls_before = _totals("DecodeServer", "num_remote_pulls")
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                "logprobs": 0})
    assert status == 200, body
    token_ids = offline.tokenizer.encode(prompt)
    expected = offline(token_ids, 12)
    choice = body["choices"][0]
    assert choice["text"] == offline.tokenizer.decode(expected)
    assert len(choice["logprobs"]["token_logprobs"]) == 12
    assert token_counts(body["usage"]) == {"prompt_tokens": len(token_ids), "completion_tokens": 12, "total_tokens": len(token_ids) + 12}
    pulled = _totals("DecodeServer", "num_remote_pulls") - pulls_before
    assert pulled == (1 if prompt is LONG else 0)


def test_a_long_prompt_the_decode_pool_holds_is_prefilled_there(app):
    """The ingress reads the decode router's prefix index (the routing scope it shares with its routers)."""
    prompt = " ".join(f"held{i}" for i in range(150))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def prefilled_locally() -> bool:
        pulls_before = _totals("DecodeServer", "num_remote_pulls")
        status, answer = app.post("/v1/completions", body)
        assert status == 200, answer
        return _totals("DecodeServer", "num_remote_pulls") == pulls_before

    assert not prefilled_locally()  # the first time, remotely: nobody holds it
    # Once the decode replica's next routing report reaches the ingress's router, it prefills there.
    wait_until(prefilled_locally, timeout=30)


def test_a_remote_prefill_never_runs_past_max_model_len(app):
    prompt = [5 + (i * 7) % 1000 for i in range(4095)]  # the built-in model's length is 4096
    prefilled_before = _totals("PrefillServer", "num_prompt_tokens")
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 100,
                                                "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert token_counts(body["usage"]) == {"prompt_tokens": 4095, "completion_tokens": 1, "total_tokens": 4096}
    assert body["choices"][0]["finish_reason"] == "length"
    assert _totals("PrefillServer", "num_prompt_tokens") == prefilled_before + 4095  # it was prefilled remotely
    wait_until(_idle_and_clean, timeout=30)


def test_streamed_chat_equals_non_streamed_and_reports_usage(app, offline):
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 10, "temperature": 0}
    status, whole = app.post("/v1/chat/completions", body)
    assert status == 200, whole
    events = app.stream_events("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert text == whole["choices"][0]["message"]["content"]
    assert token_counts(events[-1]["usage"]) == token_counts(whole["usage"]) and whole["usage"]["completion_tokens"] == 10
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


def test_stop_strings_cut_the_text(app, offline):
    status, free = app.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 16, "temperature": 0})
    text = free["choices"][0]["text"]
    stop = text[5:8]
    status, cut = app.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 16, "temperature": 0,
                                               "stop": [stop]})
    assert status == 200
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "n": 9}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "frobnicate": True}, 400, "frobnicate"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x " * 5000}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, 2, 10**7]}, 400, "prompt"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "seed": 2**63}, 400, "seed"),
        ({"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
        ({"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed"),
        ({"model": MODEL, "prompt": "a \ud800 b"}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "stop": ["\udfff"]}, 400, "stop"),
        ({"model": MODEL, "prompt": [True, False]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1, True]]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
        ({"model": MODEL, "prompt": "x", "stop": ["x" * 4000, "y" * 97]}, 400, "stop"),
    ],
)
def test_bad_requests_get_openai_errors(app, body, status, param):
    got, response = app.post("/v1/completions", body)
    assert got == status, response
    assert response["error"]["param"] == param and response["error"]["message"]
    assert app.request("GET", "/health")[0] == 200


def test_neutral_unimplemented_fields_are_accepted(app):
    status, body = app.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
        "user": "u1", "presence_penalty": 0, "logprobs": False, "tools": None, "temperature": 0,
    })
    assert status == 200 and body["usage"]["completion_tokens"] <= 3


def test_recompute_fallback_after_an_expired_lease_gives_the_same_output(app, offline):
    from ray import serve

    from pd.engine.request import KVSource
    from pd.serve.protocol import DecodeChunk, PoolRequest, PrefillResult
    from router.protocol import RouteHints

    token_ids = offline.tokenizer.encode(LONG)
    params = SamplingParams(max_tokens=8, temperature=0)
    request = PoolRequest(request_id="expired-lease", token_ids=tuple(token_ids), sampling=params)
    hints = RouteHints(request_id="expired-lease").encode()
    prefill = serve.get_deployment_handle("PrefillServer", "pd")
    result = PrefillResult.decode(prefill.prefill.remote(hints, request.encode()).result())
    # Lease expiry on the prefill replica is the event under test: wait for it.
    wait_until(lambda: _totals("PrefillServer", "num_leases_expired") >= 1, timeout=15)
    fallbacks = _totals("DecodeServer", "num_recompute_fallbacks")
    decode = serve.get_deployment_handle("DecodeServer", "pd").options(stream=True)
    remote = request.replace(kv_handle=result.kv_handle, first_token_id=result.first_token_id)
    tokens = [result.first_token_id]
    for data in decode.generate.remote(hints, remote.encode()):
        chunk = DecodeChunk.decode(data)
        tokens += chunk.token_ids
        assert chunk.kv_source is KVSource.RECOMPUTE
    assert tokens == offline(token_ids, 8)
    assert _totals("DecodeServer", "num_recompute_fallbacks") == fallbacks + 1


def test_client_disconnect_frees_every_block(app):
    url = urllib.parse.urlparse(app.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline()  # a few events arrive; the request is live on the pools
    conn.close()
    wait_until(_idle_and_clean, timeout=30)


def test_handle_api_from_another_app(app, ray_cluster):
    from ray import serve

    from pd.serve import GenerateChunk, GenerateRequest

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Caller:
        def __init__(self):
            self.pd = serve.get_app_handle("pd")

        async def __call__(self, prompt: str) -> dict:
            chunks = []
            async for chunk in self.pd.options(stream=True).generate.remote(
                GenerateRequest(prompt=prompt, max_tokens=6, temperature=0)
            ):
                assert isinstance(chunk, GenerateChunk)
                chunks.append(chunk)
            return {"text": "".join(c.text for c in chunks), "usage": chunks[-1].usage,
                    "finish_reason": chunks[-1].finish_reason}

    handle = serve.run(Caller.bind(), name="caller", route_prefix="/caller")
    try:
        result = handle.remote(SHORT).result()
    finally:
        serve.delete("caller")
    status, direct = app.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 6, "temperature": 0})
    assert result["text"] == direct["choices"][0]["text"]
    assert result["usage"]["completion_tokens"] == 6 and result["finish_reason"] == "length"


def test_a_lone_surrogate_in_a_chat_message_is_a_400(app):
    for content in ("hi \ud800", [{"type": "text", "text": "\udbff"}]):
        status, body = app.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]})
        assert status == 400 and body["error"]["param"].startswith("messages"), body


@pytest.mark.parametrize(
    "path, raw, status",
    [
        ("/v1/completions", b'{"model": "builtin:tiny-llama", "prompt": "x"', 400),  # malformed JSON
        ("/v1/completions", b'{"model": "builtin:tiny-llama", "prompt": "\xff\xfe"}', 400),  # invalid UTF-8
        ("/v1/completions", b'{"model": "builtin:tiny-llama", "prompt": 12}', 400),  # wrong type
        ("/v1/completions", b'{"model": "builtin:tiny-llama", "prompt": "' + b"x" * (10 * 1024**2) + b'"}', 413),
        ("/v1/chat/completions", b'{"model": "builtin:tiny-llama", "messages": []}', 400),
        ("/v1/chat/completions", b'{"model": "builtin:tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}', 400),
        ("/v1/completions", b'{"model": "builtin:tiny-llama", "prompt": "x", "top_p": 7}', 400),
    ],
    ids=["malformed-json", "invalid-utf8", "wrong-type", "10MB-body", "empty-messages", "unknown-role", "absurd-top_p"],
)
def test_bad_bodies_get_openai_errors_and_the_app_stays_healthy(app, path, raw, status):
    request = urllib.request.Request(app.url + path, data=raw, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            got, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        got, body = exc.code, exc.read()
    assert got == status, body[:300]
    error = json.loads(body)["error"]
    assert error["message"] and "Traceback" not in error["message"]
    assert app.request("GET", "/health")[0] == 200
