"""Every response names its request (``x-request-id``), and ``GET /debug/requests/{id}`` shows where its time went.

On the default app: a SHORT prompt prefills on its decode replica, a LONG one
on the prefill pool, whose KV the decode replica pulls.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest

from tests.serve.conftest import replica_ids, wait_until

pytestmark = pytest.mark.integration

MODEL = "builtin:tiny-llama"
SHORT = "Tell me about the sea."
LONG = " ".join(f"word{i}" for i in range(150))


def _call(url: str, method: str, body: dict | None = None, headers: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()


def _timeline(app, request_id: str) -> dict:
    status, _, text = _call(f"{app.url}/debug/requests/{request_id}", "GET")
    assert status == 200, text
    return json.loads(text)


def _spans(timeline: dict) -> dict[str, dict]:
    return {span["name"]: span for span in timeline["spans"]}


def test_a_local_prefill_is_named_and_its_timeline_found_by_either_id(default_app):
    client_id = f"client-{uuid.uuid4().hex}"
    status, headers, text = _call(f"{default_app.url}/v1/completions", "POST",
                                  {"model": MODEL, "prompt": SHORT, "max_tokens": 4, "temperature": 0},
                                  {"x-request-id": client_id})
    assert status == 200, text
    body = json.loads(text)
    # Serve's proxy echoes the client's id, once; the completion's own id finds the request too.
    assert headers.get_all("x-request-id") == [client_id] and body["id"].startswith("cmpl-")
    timeline = _timeline(default_app, body["id"])
    assert _timeline(default_app, client_id)["request_id"] == body["id"]
    assert timeline["status"] == "ok" and timeline["attributes"]["x_request_id"] == client_id
    spans = _spans(timeline)
    assert {"tokenize", "route", "decode", "decode.queue", "decode.compute"} <= set(spans)
    assert spans["route"]["attributes"]["prefill"] == "local"
    decode = spans["decode"]["attributes"]
    assert decode["replica"] in replica_ids("pd", "DecodeServer") and decode["kv_source"] == "local"
    assert decode["num_output_tokens"] == 4 and decode["finish_reason"] == "length"
    # Where the time went adds up: the engine's spans lie inside the decode call, in order.
    assert spans["decode"]["start_s"] <= spans["decode.queue"]["start_s"] + 1e-6
    assert spans["decode.queue"]["end_s"] <= spans["decode.compute"]["start_s"] + 1e-6
    assert spans["decode.compute"]["end_s"] <= timeline["duration_s"] + 1e-6


def test_a_remote_prefill_shows_the_prefill_call_and_the_kv_pull(default_app):
    events = []
    status, headers, text = _call(f"{default_app.url}/v1/chat/completions", "POST",
                                  {"model": MODEL, "stream": True, "max_tokens": 3, "temperature": 0,
                                   "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} {LONG}"}]})
    assert status == 200, text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    timeline = _timeline(default_app, headers["x-request-id"])  # Serve's own id: the client sent none
    assert timeline["request_id"] == events[0]["id"] and len(headers.get_all("x-request-id")) == 1
    spans = _spans(timeline)
    assert timeline["status"] == "ok" and spans["route"]["attributes"]["prefill"] == "remote"
    assert spans["prefill"]["attributes"]["replica"] in replica_ids("pd", "PrefillServer")
    assert {"prefill.handler", "prefill.queue", "prefill.compute", "decode.kv_pull"} <= set(spans)
    # The replica's handler lies inside the call, and the engine's intervals inside the handler.
    handler, call = spans["prefill.handler"], spans["prefill"]
    assert call["start_s"] - 1e-6 <= handler["start_s"] <= spans["prefill.queue"]["start_s"] + 1e-6
    assert handler["end_s"] == pytest.approx(call["end_s"])
    assert spans["decode"]["attributes"]["kv"] == "remote"
    pull = spans["decode.kv_pull"]["attributes"]
    assert pull["blocks"] > 0 and pull["bytes"] > 0
    assert spans["prefill"]["end_s"] <= spans["decode"]["start_s"] + 1e-6


def test_a_request_is_one_trace_across_its_processes_under_the_clients_traceparent(default_app, ray_cluster):
    """Every test app exports its traces to the session's OTLP collector (tests/serve/conftest.py)."""
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    status, headers, text = _call(f"{default_app.url}/v1/completions", "POST",
                                  {"model": MODEL, "prompt": f"{uuid.uuid4().hex} {LONG}", "max_tokens": 3,
                                   "temperature": 0}, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert status == 200, text
    collector = ray_cluster["collector"]
    expected = {"pd.request", "prefill.engine", "decode.engine"}  # each process exports on its own schedule
    spans = wait_until(lambda: {s.name: s for s in collector.spans(trace_id)}
                       if expected <= {s.name for s in collector.spans(trace_id)} else None, timeout=30)
    root = spans["pd.request"]
    assert root.parent_span_id == client_span and root.attributes["pd.x_request_id"] == headers["x-request-id"]
    assert root.service == "pd" and root.attributes["pd.status"] == "ok"
    for name in ("tokenize", "route", "prefill", "decode"):
        assert spans[name].parent_span_id == root.span_id, name
    # The routing decision: why that replica, and how much of the prompt it held.
    for role in ("prefill", "decode"):
        assert spans[role].attributes["pd.routing_reason"] and spans[role].attributes["pd.matched_tokens"] >= 0
    # Each replica's spans come from its own process, under the span of the ingress's call to it.
    for role, deployment in (("prefill", "PrefillServer"), ("decode", "DecodeServer")):
        engine = spans[f"{role}.engine"]
        assert engine.parent_span_id == spans[role].span_id
        assert engine.resource["pd.role"] == role and engine.resource["process.pid"] != root.resource["process.pid"]
        assert engine.resource["service.instance.id"] == spans[role].attributes["pd.replica"]
        assert engine.resource["service.instance.id"] in replica_ids("pd", deployment)
    for name in ("prefill.queue", "prefill.compute"):
        assert spans[name].parent_span_id == spans["prefill.engine"].span_id, name
    for name in ("decode.queue", "decode.kv_pull", "decode.compute", "decode.generate"):
        assert spans[name].parent_span_id == spans["decode.engine"].span_id, name
    pull = spans["decode.kv_pull"].attributes
    assert pull["pd.bytes"] > 0 and pull["pd.descriptors"] >= 1 and pull["pd.gb_per_s"] > 0
    assert pull["pd.backend"] == "nixl" and spans["prefill.compute"].attributes["pd.chunks"] >= 1
    assert root.start_ns <= spans["prefill"].start_ns <= spans["prefill"].end_ns <= spans["decode"].start_ns
    assert spans["decode"].end_ns <= root.end_ns


def test_an_error_names_the_request_and_ends_its_timeline(default_app):
    status, headers, text = _call(f"{default_app.url}/v1/completions", "POST",
                                  {"model": MODEL, "prompt": SHORT, "max_tokens": 4, "temperature": 0,
                                   "stop": ["x"] * 1000})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert headers.get_all("x-request-id") == [error["request_id"]]
    timeline = _timeline(default_app, error["request_id"])
    assert timeline["status"] == "error" and timeline["attributes"]["http_status"] == 400
    # Refused before a timeline is opened (the model is wrong): still named, not kept.
    status, headers, text = _call(f"{default_app.url}/v1/completions", "POST", {"model": "nope", "prompt": SHORT})
    assert status == 404 and headers.get_all("x-request-id") == [json.loads(text)["error"]["request_id"]]


def test_an_unknown_id_is_a_404_naming_it_and_the_list_is_newest_first(default_app):
    status, headers, text = _call(f"{default_app.url}/debug/requests/cmpl-unknown", "GET")
    assert status == 404
    error = json.loads(text)["error"]
    assert error["code"] == "request_not_found" and "cmpl-unknown" in error["message"]
    status, _, text = _call(f"{default_app.url}/debug/requests?limit=2", "GET")
    listing = json.loads(text)
    assert status == 200 and len(listing["data"]) == 2 and listing["capacity"] == 1000
    assert listing["data"][0]["arrived_unix"] >= listing["data"][1]["arrived_unix"]


def test_a_prompt_scored_prefills_remotely_though_its_decode_replica_holds_its_prefix(default_app):
    # best_of's later choices prefill on the first one's decode replica, which then holds the prompt's
    # blocks; an echo with logprobs needs every position's logits, which no cached block has, so the
    # decode replica would compute the whole long prompt in its decode steps: it must prefill remotely.
    prompt = " ".join(f"scored{i}" for i in range(150))

    def route_of(**fields) -> str:
        status, _, text = _call(f"{default_app.url}/v1/completions", "POST",
                                {"model": MODEL, "prompt": prompt, "temperature": 0, **fields})
        assert status == 200, text
        routes = [span for span in _timeline(default_app, json.loads(text)["id"])["spans"] if span["name"] == "route"]
        return routes[0]["attributes"]["prefill"]  # best_of's first choice; the others are pinned

    assert route_of(max_tokens=2, best_of=3) == "remote"
    # Once the decode router has read the replica's cache events (as it routes a stream), a plain request
    # with the prompt prefills on the decode replica, which holds it.
    wait_until(lambda: route_of(max_tokens=2) == "local")
    assert route_of(max_tokens=0, echo=True, logprobs=2) == "remote"
    assert route_of(max_tokens=2, echo=True, logprobs=1) == "remote"


def test_the_choices_of_a_scored_prompt_score_it_once(default_app):
    # Every choice echoes the prompt's scores, which are the same for all: the later choices, pinned to the
    # first one's decode replica, must take its cached prompt rather than compute every position again.
    prompt = " ".join(f"choice{i}" for i in range(150))
    status, _, text = _call(f"{default_app.url}/v1/completions", "POST",
                            {"model": MODEL, "prompt": prompt, "max_tokens": 2, "n": 3, "echo": True, "logprobs": 1,
                             "temperature": 0.8})
    assert status == 200, text
    body = json.loads(text)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    num_prompt = body["usage"]["prompt_tokens"]
    echoed = [c["logprobs"]["token_logprobs"][:num_prompt] for c in choices]
    assert len(echoed[0]) == num_prompt and echoed[0][0] is None and echoed[1] == echoed[0] == echoed[2]
    timeline = _timeline(default_app, body["id"])
    later = [span for span in timeline["spans"] if span["name"] == "decode"
             and not span["attributes"]["request_id"].endswith("-0")]
    assert len(later) == 2 and all(span["attributes"]["num_cached_tokens"] > 0 for span in later), later
