"""``draft_model``: a smaller checkpoint drafts, run by the engine's own code with its own KV pool; the output is
the target's, exactly, whatever the draft."""

from __future__ import annotations

import pytest

from pd import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 14, 3, 7, 5, 9, 14, 3], [2, 8, 8, 2, 8, 8, 2], list(range(30, 75))]
OPTIONS = {"num_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 32}


def _spec(draft, k=4):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "backoff": False}


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(str(checkpoint("llama")), **OPTIONS)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, temperature=0, logprobs=1),
                                    SamplingParams(max_tokens=20, temperature=0.9, seed=3)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft", ["llama", "qwen2"], ids=["itself", "another"])
def test_a_draft_models_drafts_change_nothing(checkpoint, plain, params, draft):
    """The target as its own draft (every draft right but at near-ties) and a random model of another
    architecture with the same vocabulary (most drafts wrong): both give the target's tokens. The 45-token
    prompt catches the draft up over two steps (32 tokens a step)."""
    reference = plain.generate(PROMPTS, params)
    with LLM(str(checkpoint("llama")), **OPTIONS, speculative_config=_spec(checkpoint(draft))) as spec:
        outputs = spec.generate(PROMPTS, params)
        stats = spec.engine.stats()
        proposer = spec.engine.speculator.proposer
        assert proposer.pool.num_used_blocks == 0  # every request's draft blocks came back
        assert proposer.seconds_per_token > 0
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    if params.logprobs is not None:
        assert [o.logprobs for o in outputs] == [pytest.approx(r.logprobs, abs=1e-4) for r in reference]
    assert stats.spec_num_draft_tokens > 0
    if draft == "llama" and params.temperature == 0:
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
        assert stats.decode_steps < 0.4 * sum(len(o.token_ids) for o in outputs)


def test_a_draft_of_another_vocabulary_is_refused_naming_both(checkpoint):
    with pytest.raises(ValueError, match="vocabulary of 509 tokens; the target's has 512"):
        LLM(str(checkpoint("llama")), **OPTIONS, speculative_config=_spec(checkpoint("llama_bias")))
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(str(checkpoint("llama")), **OPTIONS, speculative_config={"method": "draft_model"})
