"""The engine equals HF transformers on every architecture it claims."""

from __future__ import annotations

import pytest
import torch

from pd import LLM, SamplingParams
from pd.model.attention import AttentionMetadata
from tests.reference import assert_greedy_match, greedy_references

ARCHITECTURES = ["llama", "qwen2", "mistral", "qwen3"]
PROMPT_LENS = (3, 29, 70, 131)
MAX_NEW = 32


def prompts(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(checkpoint, hf_model):
    return greedy_references(checkpoint, hf_model, prompts(), MAX_NEW)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_greedy_batched_matches_hf(kind, checkpoint, references):
    llm = LLM(str(checkpoint(kind)), num_blocks=128)
    outputs = llm.generate(prompts(), GREEDY)
    for out, (ref_tokens, gaps) in zip(outputs, references(kind)):
        assert out.finish_reason == "length"
        assert_greedy_match(out.token_ids, ref_tokens, gaps)


@pytest.mark.parametrize("form", ["onednn", "dense"])
def test_either_form_of_the_dense_layers_matches_hf(form, checkpoint, references):
    """The test models are under the probe's size, so ``auto`` runs oneDNN here: the dense form too."""
    llm = LLM(str(checkpoint("qwen2")), num_blocks=128, linear_form=form)
    assert llm.engine.runner.linear_form == form
    outputs = llm.generate(prompts(), GREEDY)
    for out, (ref_tokens, gaps) in zip(outputs, references("qwen2")):
        assert_greedy_match(out.token_ids, ref_tokens, gaps)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("budget", [16, 4096])
def test_chunked_prefill_is_identical(kind, budget, checkpoint, references):
    llm = LLM(str(checkpoint(kind)), num_blocks=128, max_num_batched_tokens=budget)
    outputs = llm.generate(prompts(), GREEDY)
    for out, (ref_tokens, gaps) in zip(outputs, references(kind)):
        assert_greedy_match(out.token_ids, ref_tokens, gaps)


def test_prefix_cache_hits_and_identical_outputs(checkpoint, references):
    llm = LLM(str(checkpoint("llama")), num_blocks=128, block_size=16)
    first = llm.generate(prompts(), GREEDY)
    assert [o.num_cached_tokens for o in first] == [0, 0, 0, 0]
    second = llm.generate(prompts(), GREEDY)
    # Full blocks of prompt + generated tokens are cached; at least one token is always recomputed.
    assert [o.num_cached_tokens for o in second] == [(n - 1) // 16 * 16 for n in PROMPT_LENS]
    assert llm.engine.stats().num_prefix_hit_tokens == sum((n - 1) // 16 * 16 for n in PROMPT_LENS)
    # What the model computed: every prompt token the first time, only the uncached ones the second.
    assert llm.engine.stats().num_computed_prompt_tokens == 2 * sum(PROMPT_LENS) - sum(
        (n - 1) // 16 * 16 for n in PROMPT_LENS)
    for out, (ref_tokens, gaps) in zip(second, references("llama")):
        assert_greedy_match(out.token_ids, ref_tokens, gaps)


def test_preemption_under_tiny_pool_is_identical(checkpoint, references):
    # Longest first: the three longest are admitted into 16 blocks, then their
    # decodes need 22 and force preemption by recompute.
    llm = LLM(str(checkpoint("llama")), num_blocks=16, block_size=16)
    outputs = llm.generate(prompts()[::-1], GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    for out, (ref_tokens, gaps) in zip(outputs, references("llama")[::-1]):
        assert_greedy_match(out.token_ids, ref_tokens, gaps)
    assert llm.engine.stats().num_used_blocks == 0


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_teacher_forced_logits_match_hf(kind, checkpoint, hf_model):
    """Logits at every position of one prompt, fed in two chunks through the paged cache."""
    tokens = prompts(seed=5)[3]
    with torch.no_grad():
        expected = hf_model(checkpoint(kind))(torch.tensor([tokens])).logits[0]
    llm = LLM(str(checkpoint(kind)), num_blocks=32, block_size=16)
    runner = llm.engine.runner
    blocks = list(range(-(-len(tokens) // 16)))
    got = []
    for start, end in ((0, 50), (50, len(tokens))):
        attn = AttentionMetadata(
            slot_mapping=torch.arange(start, end),
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_table=torch.tensor([blocks], dtype=torch.int32),
            backend="torch",
        )
        with torch.inference_mode():
            got.append(runner.model.forward(
                torch.tensor(tokens[start:end]), torch.arange(start, end), attn, runner.kv_views,
                torch.arange(end - start),
            ))
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-4, rtol=1e-4)
