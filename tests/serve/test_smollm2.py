"""The trained default model served as ``make serve`` serves it, on both prefill paths, against HF.

Short chats prefill on the decode replica; each long one (a system prompt of its own, past the app's
64-token threshold) on the prefill pool, its KV pulled over NIXL. HF ``transformers`` reads the same GGUF.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.conftest import SMOLLM2, SMOLLM2_PROMPTS
from tests.reference import teacher_forced_divergence
from tests.serve.conftest import Client, ensure_app, pool_stats

THRESHOLD = 64
LONG_SYSTEM = ("You are a careful assistant. You answer briefly and plainly, in English, and you say so when you "
               "do not know. You never make up facts, names or places, and you keep to the question asked.")
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def app(ray_cluster):
    ensure_app("default.yaml", engine={"model": SMOLLM2, "dtype": "float32", "kv_cache_bytes": 64 * 1024**2},
               remote_prefill_threshold=THRESHOLD)
    return Client(ray_cluster["url"])


@pytest.fixture(scope="module")
def tokenizer():
    from pd.model.paths import resolve_model_path
    from pd.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_path(SMOLLM2))


def pulls() -> int:
    return sum(s["num_remote_pulls"] for s in pool_stats("DecodeServer"))


def prefilled_remotely() -> int:
    return sum(s["num_prompt_tokens"] for s in pool_stats("PrefillServer"))


def messages_for(path: str, prompt: str) -> list[dict]:
    if path == "local":
        return [{"role": "user", "content": prompt}]
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex}. {LONG_SYSTEM}"},
            {"role": "user", "content": prompt}]


@pytest.mark.parametrize("path", ["local", "remote"])
def test_served_greedy_answers_equal_hf_on_either_prefill_path(app, tokenizer, smollm2_hf, path):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    [listed] = sdk.models.list().data
    assert listed.id == SMOLLM2
    model, _ = smollm2_hf
    before = pulls()
    for prompt in SMOLLM2_PROMPTS:
        messages = messages_for(path, prompt)
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        assert (len(prompt_ids) > THRESHOLD) == (path == "remote")
        out = sdk.chat.completions.create(model=listed.id, messages=messages, max_tokens=16, temperature=0)
        text = out.choices[0].message.content
        ours = tokenizer.encode(text, add_special_tokens=False)
        if out.choices[0].finish_reason == "stop":
            ours.append(tokenizer.eos_token_id)
        divergence = teacher_forced_divergence(ours, model, prompt_ids)
        assert divergence is None, (prompt, text, divergence)
    assert pulls() - before == (len(SMOLLM2_PROMPTS) if path == "remote" else 0)


@pytest.mark.parametrize("path", ["local", "remote"])
def test_served_prompt_logprobs_equal_hf_log_softmax(app, tokenizer, smollm2_hf, path):
    model, _ = smollm2_hf
    for prompt in SMOLLM2_PROMPTS[:3]:
        text = tokenizer.apply_chat_template(messages_for(path, prompt))
        before = prefilled_remotely()
        status, body = app.post("/v1/completions", {"model": SMOLLM2, "prompt": text, "max_tokens": 0, "echo": True,
                                                    "logprobs": 1, "temperature": 0})
        assert status == 200, body
        token_ids = tokenizer.encode(text)
        assert prefilled_remotely() - before == (len(token_ids) if path == "remote" else 0)  # scored where it ran
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
        expected = reference[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]
        got = torch.tensor(body["choices"][0]["logprobs"]["token_logprobs"][1:])
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=LOGPROB_ATOL), (got - expected).abs().max()
