"""Speculative decoding in the engine: whatever is drafted, outputs are the non-speculative engine's.

An oracle proposer drafts the reference continuation with one token in
three corrupted, so every verify step mixes accepted and rejected drafts.
Greedy and seeded requests must return exactly the tokens of the engine
without speculation; the pool's blocks all come back; logprobs, stop tokens
and ``max_tokens`` behave as without it.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.config.app import EngineArgs
from pd.sampling_params import StructuredKind, StructuredOutput

PROMPTS = [[1, 5, 9, 14, 3, 7, 5, 9, 14, 3], [2, 8, 8, 2, 8, 8, 2], [4, 6, 10, 12, 40, 41, 42, 43, 44, 45, 46]]


class Oracle:
    """Drafts the reference's tokens at each position (``reference[prompt]``), every third one wrong."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], num_prompt: dict[tuple[int, ...], int]):
        self.reference, self.num_prompt = reference, num_prompt
        self.calls = 0

    def propose(self, request_id, token_ids, k):
        self.calls += 1
        for prompt, tokens in self.reference.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt:
                full = list(prompt) + tokens
                drafts = full[len(token_ids):len(token_ids) + k]
                return [t if (len(token_ids) + i) % 3 else (t + 1) % 256 for i, t in enumerate(drafts)]
        return []

    def finish(self, request_id, token_ids, num_prompt_tokens):
        pass


def _run(llm, params, oracle=None):
    if oracle is not None:
        llm.engine.speculator.proposer = oracle
    return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def engines(checkpoint):
    path = str(checkpoint("llama"))
    plain = LLM(path, num_blocks=64, max_model_len=256)
    spec = LLM(path, num_blocks=64, max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "backoff": False})
    return plain, spec


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, logprobs=2),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, logprobs=0),
    SamplingParams(max_tokens=13, temperature=0, stop_token_ids=(200,)),
], ids=["greedy", "seeded", "stop"])
def test_outputs_are_the_non_speculative_engines_whatever_is_drafted(engines, params):
    plain, spec = engines
    reference = _run(plain, params)
    oracle = Oracle({tuple(p): out.token_ids for p, out in zip(PROMPTS, reference)}, {})
    before = spec.engine.stats()
    outputs = _run(spec, params, oracle)
    after = spec.engine.stats()
    for ref, out in zip(reference, outputs):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == ref.finish_reason
        if params.logprobs is not None:
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # both paths ran
    steps = after.decode_steps - before.decode_steps
    assert steps < sum(len(o.token_ids) for o in outputs)  # fewer steps than tokens: drafts were accepted
    assert after.num_used_blocks == 0  # every block of every rejected draft came back


def _corrupting_oracle(reference: dict[tuple[int, ...], list[int]], wrong: set[int]):
    """Drafts the reference at each position, wrong at the positions in ``wrong``."""

    class _Drafts(Oracle):
        def propose(self, request_id, token_ids, k):
            for prompt, tokens in self.reference.items():
                if tuple(token_ids[:len(prompt)]) == prompt:
                    full = list(prompt) + tokens
                    at = len(token_ids)
                    return [t if at + i not in wrong else (t + 7) % 256 for i, t in enumerate(full[at:at + k])]
            return []

    return _Drafts(reference, {})


@pytest.fixture(scope="module")
def small_pool(checkpoint):
    """Engines with 10 blocks of 4 tokens: three requests of 40 tokens cannot all stay, so some are preempted."""
    path = str(checkpoint("llama"))
    options = {"num_blocks": 10, "block_size": 4, "max_model_len": 64}
    return (LLM(path, **options),
            LLM(path, **options, speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                                      "backoff": False}))


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wrong=st.sets(st.integers(min_value=8, max_value=60), max_size=30))
def test_block_pool_invariants_hold_under_any_accepts_and_rejects_with_preemption(small_pool, wrong):
    plain, spec = small_pool
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    prompts = [p[:8] for p in PROMPTS]
    reference = plain.generate(prompts, params)
    spec.engine.speculator.proposer = _corrupting_oracle(
        {tuple(p): out.token_ids for p, out in zip(prompts, reference)}, wrong)
    engine, pool, block_size = spec.engine, spec.engine.block_pool, 4
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        for request in engine.scheduler.running:  # no block beyond what the accepted tokens need
            held = engine.kv_cache.block_ids(request.request_id)
            assert len(held) <= -(-request.num_tokens // block_size)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [out.token_ids for out in reference]
    assert pool.num_used_blocks == 0
    assert engine.stats().num_preemptions > 0  # the pool is small enough that recompute ran too
    # The prefix cache holds only accepted tokens: the same prompts hit it and decode the same again.
    again = spec.generate(prompts, params)
    assert [out.token_ids for out in again] == [out.token_ids for out in reference]


def test_structured_output_with_drafts_is_the_same_valid_json(checkpoint):
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                          "age": {"type": "integer"}},
                         "required": ["name", "age"], "additionalProperties": False})
    params = SamplingParams(max_tokens=64, temperature=0,
                            structured=StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=schema))
    prompts = ["Name and age of a person:", "Give me JSON"]
    plain = LLM("builtin:tiny-llama", num_blocks=64)
    reference = plain.generate(prompts, params)
    spec = LLM("builtin:tiny-llama", num_blocks=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "backoff": False})
    ids = [plain.tokenizer.encode(p) for p in prompts]
    # Drafts right and wrong, some outside the grammar: the matcher must roll back from each.
    spec.engine.speculator.proposer = _corrupting_oracle(
        {tuple(i): out.token_ids for i, out in zip(ids, reference)}, set(range(0, 200, 3)))
    outputs = spec.generate(prompts, params)
    for ref, out in zip(reference, outputs):
        assert out.token_ids == ref.token_ids
        json.loads(out.text)
    assert spec.engine.stats().spec_num_accepted_tokens > 0


def test_speculative_config_is_checked_naming_the_key():
    with pytest.raises(ValueError, match="unknown key.*'lookahead'"):
        EngineConfig(speculative_config={"method": "ngram", "lookahead": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        EngineConfig(speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="needs a method"):
        EngineConfig(speculative_config={"num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative_config={"method": "suffix"}, async_scheduling=True)
    with pytest.raises(ValidationError, match="lookahead"):  # the YAML's engine: section
        EngineArgs(speculative_config={"method": "ngram", "lookahead": 3})
    config = EngineArgs(speculative_config={"method": "suffix", "num_speculative_tokens": 6}).engine_config(30.0, 10.0)
    assert config.speculative_config.method == "suffix" and config.speculative_config.num_speculative_tokens == 6
