"""A failure that belongs to one request fails that request only."""

from __future__ import annotations

import pytest

from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.engine.request import FinishReason
from tests.checkpoints import make_poisoned_checkpoint

POISON = 77
PROMPTS = [list(range(10, 40)), list(range(50, 70)), list(range(100, 140))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    return str(make_poisoned_checkpoint(tmp_path_factory.mktemp("poisoned"), POISON))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs = {request_id: [] for request_id in requests}
    reasons: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.error)
    return {request_id: (outputs[request_id], *reasons[request_id]) for request_id in requests}


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(poisoned, temperature):
    engine = LLMEngine(EngineConfig(model=poisoned, num_blocks=64))
    expected = LLM(poisoned, num_blocks=64).generate(PROMPTS, GREEDY)
    tiny = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True, seed=1)
    results = run(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)} | {"tiny": (PROMPTS[0], tiny)})
    for i, out in enumerate(expected):
        assert results[f"r{i}"] == (out.token_ids, FinishReason.LENGTH, None)
    assert results["tiny"] == (expected[0].token_ids, FinishReason.LENGTH, None)


def test_nan_logits_fail_their_own_request_only(poisoned):
    engine = LLMEngine(EngineConfig(model=poisoned, num_blocks=64))
    expected = LLM(poisoned, num_blocks=64).generate(PROMPTS, GREEDY)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    results = run(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
                  | {"nan-greedy": ([5, 6, POISON, 8], GREEDY), "nan-sampled": ([POISON, 9], sampled)})
    for i, out in enumerate(expected):
        assert results[f"r{i}"] == (out.token_ids, FinishReason.LENGTH, None)
    for request_id in ("nan-greedy", "nan-sampled"):
        tokens, reason, error = results[request_id]
        assert tokens == [] and reason is FinishReason.ERROR and "non-finite logits" in error
    assert engine.stats().num_used_blocks == 0
