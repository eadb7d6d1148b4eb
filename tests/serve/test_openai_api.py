"""The OpenAI API as clients send it: the official SDK, guidellm's request shape, lm-eval's echo.

Both prefill paths: SHORT prompts prefill on the decode replica, LONG ones
on the prefill pool (over the 256-token threshold of the default app).
"""

from __future__ import annotations

import json
import uuid

import jsonschema
import pytest
import torch

from tests.serve.conftest import pool_stats

MODEL = "builtin:tiny-llama"
SHORT = "Tell me about the sea."
LONG = " ".join(f"word{i}" for i in range(150))
PATHS = pytest.mark.parametrize("path", ["local", "remote"])


def prompt_for(path: str) -> str:
    """SHORT, or a LONG prompt no replica holds yet, so that it is prefilled remotely."""
    return SHORT if path == "local" else f"{uuid.uuid4().hex} {LONG}"


def pulls() -> int:
    return _totals("DecodeServer", "num_remote_pulls")
# fp32 here and in HF, summed in other orders: log-probabilities agree to this.
LOGPROB_ATOL = 2e-4


@pytest.fixture
def app(default_app):
    return default_app


@pytest.fixture
def sdk(app):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    from pd.model.builtin import BUILTIN_MODELS, ensure_builtin_model

    path = ensure_builtin_model(BUILTIN_MODELS["tiny-llama"])
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]``: log-softmax of HF's logits at each position."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def _totals(deployment: str, key: str) -> int:
    return sum(s[key] for s in pool_stats(deployment))


def _computed_prompt_tokens() -> int:
    """Prompt tokens either pool computed: admitted, less prefix-cache hits and blocks pulled."""
    total = 0
    for pool in ("DecodeServer", "PrefillServer"):
        total += _totals(pool, "num_prompt_tokens") - _totals(pool, "num_prefix_hit_tokens")
    return total - _totals("DecodeServer", "num_pulled_blocks") * 16


# Tolerant fields ------------------------------------------------------------------


def test_guidellm_streaming_shape_gets_usage_in_every_chunk(app):
    """guidellm sends continuous_usage_stats (a vLLM key) and may add others inside stream_options."""
    events = app.stream_events("/v1/completions", {
        "model": MODEL, "prompt": SHORT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True, "some_future_key": 1},
    })
    with_choices = [e for e in events if e["choices"]]
    assert len(with_choices) == 6
    assert [e["usage"]["completion_tokens"] for e in with_choices] == [1, 2, 3, 4, 5, 6]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


def test_neutral_fields_at_any_value_and_developer_role(app, sdk):
    base = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    plain = sdk.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": SHORT}], **base)
    tolerant = sdk.chat.completions.create(
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": SHORT}],
        store=True, metadata={"run": "1"}, service_tier="auto", user="u1", parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="none", **base)
    assert tolerant.choices[0].message.content == plain.choices[0].message.content
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": "x", "store": False, "max_tokens": 1})
    assert status == 200, body


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "n": 9}, "n"),
    ({"prompt": "x", "best_of": 2, "n": 3}, "best_of"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_what_would_change_the_output_unimplemented_is_refused(app, body, param):
    status, answer = app.post("/v1/completions", {"model": MODEL, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


# n and best_of --------------------------------------------------------------------


@PATHS
def test_n_choices_share_the_prompt(app, sdk, path):
    prompt = prompt_for(path)
    hits_before = _totals("DecodeServer", "num_prefix_hit_tokens")
    computed_before = _computed_prompt_tokens()
    out = sdk.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=7)
    again = sdk.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    texts = [c.text for c in out.choices]
    assert texts == [c.text for c in again.choices]  # derived seeds: reproducible
    assert len(set(texts)) > 1  # and distinct
    single = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7)
    assert single.choices[0].text == texts[0]  # choice 0 keeps the request's seed
    assert 4 <= out.usage.completion_tokens <= 32  # each choice's tokens, the prompt counted once
    num_prompt = out.usage.prompt_tokens
    full_blocks = (num_prompt - 1) // 16 * 16
    hits = _totals("DecodeServer", "num_prefix_hit_tokens") - hits_before
    assert hits >= 3 * full_blocks  # choices 1..3 of the first request found the prompt cached
    computed = _computed_prompt_tokens() - computed_before
    assert computed <= 3 * num_prompt + 6 * 16  # once per request (and a partial block per choice), not per choice


def test_n_streamed_and_chat(app, sdk):
    events = app.stream_events("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": SHORT}], "n": 3, "max_tokens": 5,
        "temperature": 0.8, "seed": 1})
    finished = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events
                if e["choices"] and e["choices"][0]["finish_reason"]}
    assert sorted(finished) == [0, 1, 2]
    roles = [e["choices"][0]["index"] for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1, 2]
    greedy = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}], n=2,
                                         max_tokens=6, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_best_of_returns_the_most_likely(sdk):
    out = sdk.completions.create(model=MODEL, prompt=SHORT, n=1, best_of=3, max_tokens=6, temperature=1.0,
                                 seed=3, logprobs=0)
    runs = sdk.completions.create(model=MODEL, prompt=SHORT, n=3, max_tokens=6, temperature=1.0, seed=3, logprobs=0)
    best = max(runs.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert out.choices[0].text == best.text
    assert out.usage.completion_tokens == runs.usage.completion_tokens


# Log-probabilities ----------------------------------------------------------------


@PATHS
def test_completion_echo_scores_the_prompt_like_hf(app, hf_model, offline, path):
    """lm-eval's log-likelihood request: echo, max_tokens 0, logprobs k."""
    prompt = prompt_for(path)
    prefilled_before = _totals("PrefillServer", "num_prompt_tokens")
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True,
                                                "logprobs": 2, "temperature": 0})
    assert status == 200, body
    prefilled = _totals("PrefillServer", "num_prompt_tokens") - prefilled_before
    assert prefilled == (body["usage"]["prompt_tokens"] if path == "remote" else 0)  # scored where it ran
    token_ids = offline.tokenizer.encode(prompt)
    choice = body["choices"][0]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(token_ids) and logprobs["token_logprobs"][0] is None
    reference = hf_logprobs(hf_model, token_ids)
    expected = reference[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]
    got = torch.tensor(logprobs["token_logprobs"][1:])
    assert torch.allclose(got, expected, atol=LOGPROB_ATOL), (got - expected).abs().max()
    top = logprobs["top_logprobs"][5]
    assert len(top) <= 2 and max(top.values()) == pytest.approx(reference[4].max().item(), abs=LOGPROB_ATOL)


@PATHS
def test_prompt_logprobs_as_vllm_renders_them_like_hf(app, hf_model, offline, path):
    """vLLM's ``prompt_logprobs`` beside a generation: per position the prompt's token and the top k, by id."""
    prompt = prompt_for(path)
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                "prompt_logprobs": 3, "echo": True, "logprobs": 1})
    assert status == 200, body
    token_ids = offline.tokenizer.encode(prompt)
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 3 and choice["text"].startswith(prompt)
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(token_ids) and scores[0] is None
    reference = hf_logprobs(hf_model, token_ids)
    for position, entry in enumerate(scores[1:]):
        row = reference[position]
        own = entry[str(token_ids[position + 1])]
        assert own["logprob"] == pytest.approx(row[token_ids[position + 1]].item(), abs=LOGPROB_ATOL)
        assert own["decoded_token"] == choice["logprobs"]["tokens"][position + 1]
        top = sorted(entry.values(), key=lambda e: e["rank"] or 10**9)[:3]
        assert [e["rank"] for e in top] == [1, 2, 3] and len(entry) in (3, 4)
        assert top[0]["logprob"] == pytest.approx(row.max().item(), abs=LOGPROB_ATOL)
        assert own["rank"] is None or own["rank"] == 1 + int((row > row[token_ids[position + 1]]).sum())
    assert all(len(top) <= 1 for top in choice["logprobs"]["top_logprobs"][1:])  # echo keeps its own k


def test_prompt_logprobs_alone_and_refused_streamed(app, offline):
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 0,
                                                "prompt_logprobs": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == "" and len(choice["prompt_logprobs"]) == len(offline.tokenizer.encode(SHORT))
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    token_ids = offline.tokenizer.encode(SHORT)
    assert [list(entry) for entry in choice["prompt_logprobs"][1:]] == [[str(t)] for t in token_ids[1:]]
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 2, "stream": True,
                                                "prompt_logprobs": 1})
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt_logprobs", body  # read as a stream


@PATHS
def test_chat_top_logprobs_like_hf(sdk, hf_model, offline, path):
    prompt = prompt_for(path)
    pulls_before = pulls()
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6,
                                      temperature=0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    assert pulls() - pulls_before == (path == "remote")
    content = out.choices[0].logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 5 for entry in content)
    for entry in content:
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob == pytest.approx(values[0])
    # Teacher-forced: the prompt as the chat template renders it, then the output tokens.
    from pd.model.builtin import BUILTIN_MODELS, ensure_builtin_model
    from pd.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(ensure_builtin_model(BUILTIN_MODELS["tiny-llama"]))
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]), False)
    greedy = offline(prompt_ids, 6)
    reference = hf_logprobs(hf_model, prompt_ids + greedy)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + 5)
    expected = reference[positions, torch.tensor(greedy)]
    got = torch.tensor([entry.logprob for entry in content])
    assert torch.allclose(got, expected, atol=LOGPROB_ATOL), (got - expected).abs().max()


def test_completion_logprobs_k_alternatives(sdk):
    out = sdk.completions.create(model=MODEL, prompt=SHORT, max_tokens=4, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(lp == pytest.approx(max(top.values())) for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs))


# Prefix-cache hits ------------------------------------------------------------------


@PATHS
def test_usage_reports_cached_tokens(sdk, path):
    prompt = prompt_for(path)
    unique = f"{uuid.uuid4().hex} {prompt}"  # a first block no replica has seen
    first = sdk.completions.create(model=MODEL, prompt=unique, max_tokens=2, temperature=0)
    second = sdk.completions.create(model=MODEL, prompt=unique, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16


# Structured output and forced tool calls -------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "rooms": {"type": "integer", "minimum": 1, "maximum": 9},
    "tags": {"type": "array", "items": {"enum": ["sea", "sky", "sun"]}, "maxItems": 3},
}, "required": ["city", "rooms", "tags"]}


@PATHS
def test_json_schema_response_format_validates(sdk, path):
    """Through both paths: the remote prefill's first token obeys the grammar too."""
    prompt = prompt_for(path)
    pulls_before = pulls()
    for seed in range(3):
        out = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=120, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "hotel", "schema": SCHEMA}})
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert (pulls() > pulls_before) == (path == "remote")  # the first of them, at least, prefilled remotely


def test_guided_extensions_and_json_object(app):
    def text(body: dict) -> str:
        status, answer = app.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 60,
                                                      "temperature": 1.0, "seed": 5, **body})
        assert status == 200, answer
        return answer["choices"][0]["text"]

    assert text({"guided_choice": ["yes", "no", "maybe so"]}) in ("yes", "no", "maybe so")
    import re

    assert re.fullmatch(r"[a-c]{2,5}-\d{3}", text({"guided_regex": r"[a-c]{2,5}-\d{3}"}))
    assert isinstance(json.loads(text({"guided_json": SCHEMA, "max_tokens": 120})), dict)
    status, answer = app.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 200, "temperature": 0,
        "response_format": {"type": "json_object"}})
    assert status == 200, answer
    if answer["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("body, message, param", [
    ({"guided_json": {"type": "objec"}}, "invalid JSON schema", "guided_json"),
    ({"guided_regex": "(unclosed"}, "invalid regex", "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "invalid JSON schema", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required", "response_format"),
])
def test_bad_constraints_are_the_clients_400(app, body, message, param):
    status, answer = app.post("/v1/completions", {"model": MODEL, "prompt": SHORT, **body})
    assert status == 400, answer
    assert message in answer["error"]["message"] and answer["error"]["param"] == param
    assert app.request("GET", "/health")[0] == 200


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}},
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls(sdk, tool_choice):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": SHORT}], tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=80, temperature=1.0, seed=2)
    out = sdk.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    streamed = list(sdk.chat.completions.create(stream=True, **kwargs))
    calls = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].function.arguments == call.function.arguments.replace(" ", "") or \
        json.loads(calls[0][0].function.arguments) == json.loads(call.function.arguments)
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_auto_is_refused_by_name(app):
    status, answer = app.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "tools": TOOLS})
    assert status == 400 and answer["error"]["param"] == "tool_choice"
    assert "auto" in answer["error"]["message"]
