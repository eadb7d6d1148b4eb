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
PATHS = pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["local-prefill", "remote-prefill"])
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
def test_n_choices_share_the_prompt(app, sdk, prompt):
    hits_before = _totals("DecodeServer", "num_prefix_hit_tokens")
    prompt_before = _totals("DecodeServer", "num_prompt_tokens") + _totals("PrefillServer", "num_prompt_tokens")
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
    computed = _totals("DecodeServer", "num_prompt_tokens") + _totals("PrefillServer", "num_prompt_tokens") - prompt_before
    assert computed - hits <= 3 * num_prompt + 3 * 3 * 16  # the prompt ran once per request, not once per choice


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
def test_completion_echo_scores_the_prompt_like_hf(app, hf_model, offline, prompt):
    """lm-eval's log-likelihood request: echo, max_tokens 0, logprobs k."""
    status, body = app.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True,
                                                "logprobs": 2, "temperature": 0})
    assert status == 200, body
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
def test_chat_top_logprobs_like_hf(sdk, hf_model, offline, prompt):
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6,
                                      temperature=0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
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
def test_usage_reports_cached_tokens(sdk, prompt):
    unique = f"{uuid.uuid4().hex} {prompt}"  # a first block no replica has seen
    first = sdk.completions.create(model=MODEL, prompt=unique, max_tokens=2, temperature=0)
    second = sdk.completions.create(model=MODEL, prompt=unique, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16
