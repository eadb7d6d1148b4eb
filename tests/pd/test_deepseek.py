"""DeepSeek-V2/V3: multi-head latent attention with the latent as the KV, and DeepSeek's MoE, equal to HF."""

from __future__ import annotations

import pytest
import torch

from pd import LLM, SamplingParams
from pd.model.attention import AttentionMetadata
from pd.model.config import model_config_from_dict
from tests.checkpoints import DEEPSEEK_COMMON, DEEPSEEK_KINDS
from tests.reference import assert_greedy_match, greedy_references

PROMPT_LENS = (3, 29, 70, 131)
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
BACKEND = "cpu"  # the C++ latent decode; the torch reference answers for it in tests/pd_kernels


def prompts(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(checkpoint, hf_model):
    return greedy_references(checkpoint, hf_model, prompts(), MAX_NEW)


V3 = {"architectures": ["DeepseekV3ForCausalLM"], **DEEPSEEK_COMMON, "q_lora_rank": 24, "n_group": 2,
      "topk_group": 1, "n_shared_experts": 1}


def test_config_reads_the_latent_layout_and_the_routing():
    config = model_config_from_dict(V3)
    assert (config.num_kv_heads, config.kv_planes, config.kv_head_dim, config.head_dim) == (1, 1, 40, 8)
    assert config.kv_values_per_token == 40 * 3
    moe = config.moe
    assert (moe.scoring, moe.topk_method, moe.num_groups, moe.topk_group) == ("sigmoid", "noaux_tc", 2, 1)
    assert moe.layers == (False, True, True) and not moe.shared_expert_gated
    assert moe.shared_expert_intermediate_size == 32 and moe.renormalize
    v2 = model_config_from_dict({**V3, "architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None})
    assert (v2.moe.scoring, v2.moe.topk_method, v2.mla.q_lora_rank, v2.mla.rope_interleave) == (
        "softmax", "greedy", None, True)
    assert not v2.moe.renormalize


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ({"n_group": 3}, "n_group 3 does not divide"),
    ({"topk_group": 4}, "topk_group 4 exceeds its n_group 2"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be >= 1"),
])
def test_unsupported_configs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_dict({**V3, **change})


@pytest.mark.parametrize("kind", DEEPSEEK_KINDS)
def test_greedy_batched_and_chunked_matches_hf(kind, checkpoint, references):
    """Batched and chunked: steps mix prefill chunks (decompressed) with decodes (absorbed)."""
    llm = LLM(str(checkpoint(kind)), num_blocks=128, max_num_batched_tokens=64, attention_backend=BACKEND)
    outputs = llm.generate(prompts(), GREEDY)
    for out, (ref_tokens, gaps) in zip(outputs, references(kind)):
        assert out.finish_reason == "length"
        assert_greedy_match(out.token_ids, ref_tokens, gaps)


def test_prefix_cached_prompts_match_hf(checkpoint, references):
    """The second run reads the first's latent blocks from the prefix cache: its prefill sees cached context."""
    llm = LLM(str(checkpoint("deepseek_v3")), num_blocks=128, attention_backend=BACKEND)
    first = llm.generate(prompts(), GREEDY)
    second = llm.generate(prompts(), GREEDY)
    assert [o.num_cached_tokens for o in second] == [0, 16, 64, 128]
    for a, b, (ref_tokens, gaps) in zip(first, second, references("deepseek_v3")):
        assert_greedy_match(b.token_ids, ref_tokens, gaps)
        assert a.token_ids == b.token_ids


def test_the_pool_holds_one_latent_row_per_token_and_layer(checkpoint):
    """KV bytes per token = (kv_lora_rank + qk_rope_head_dim) x dtype bytes x layers, from the pool itself."""
    llm = LLM(str(checkpoint("deepseek_v3")), num_blocks=16, attention_backend=BACKEND)
    assert llm.kv_bytes_per_token == (32 + 8) * 4 * 3
    bf16 = LLM(str(checkpoint("deepseek_v3")), num_blocks=16, dtype="bfloat16", attention_backend=BACKEND)
    assert bf16.kv_bytes_per_token == (32 + 8) * 2 * 3
    fp8 = LLM(str(checkpoint("deepseek_v3")), num_blocks=16, kv_cache_dtype="fp8_e4m3", attention_backend=BACKEND)
    assert fp8.kv_bytes_per_token == (32 + 8) * 1 * 3


@pytest.mark.integration  # a worker process per rank
@pytest.mark.parametrize("kind, options", [
    ("deepseek_v3", {"tensor_parallel_size": 2}),  # heads split, the latent replicated on both ranks
    ("deepseek_v2", {"expert_parallel_size": 2, "expert_dispatch": "all_to_all"}),  # V2's grouped routing
])
def test_two_ranks_match_hf(kind, options, checkpoint, references):
    with LLM(str(checkpoint(kind)), num_blocks=64, max_num_batched_tokens=32, attention_backend=BACKEND,
             **options) as llm:
        outputs = llm.generate(prompts(), GREEDY)
    for out, (ref_tokens, gaps) in zip(outputs, references(kind)):
        assert_greedy_match(out.token_ids, ref_tokens, gaps)


def _step(llm, token_ids: list[int], start: int, backend: str) -> torch.Tensor:
    """Logits of ``token_ids`` at positions ``start...`` of one sequence, its context already in the pool."""
    runner = llm.engine.runner
    end = start + len(token_ids)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(start, end), cu_seqlens_q=torch.tensor([0, len(token_ids)], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_table=torch.tensor([list(range(-(-end // 16)))], dtype=torch.int32), backend=backend)
    with torch.inference_mode():
        return runner.model.forward(torch.tensor(token_ids), torch.arange(start, end), attn, runner.kv_views,
                                    torch.arange(len(token_ids)))


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_absorbed_decode_equals_the_decompressed_prefill(kind, checkpoint):
    """The same positions' logits, once as one prefill (latents expanded to per-head K/V) and once token by
    token (queries absorbed into the latent space, attending over the latent pages)."""
    llm = LLM(str(checkpoint(kind)), num_blocks=16, attention_backend=BACKEND)
    tokens = prompts()[2]
    whole = _step(llm, tokens, 0, BACKEND)
    one_by_one = torch.cat([_step(llm, [token], i, BACKEND) for i, token in enumerate(tokens)])
    torch.testing.assert_close(one_by_one, whole, rtol=1e-4, atol=1e-4)


def test_fp8_latent_pages_read_alike_on_both_paths(checkpoint):
    """An FP8 latent pool, read by the absorbed decode (its pages, scaled) and by the prefill's
    decompression (dequantized pages): the same positions' logits either way, and close to the fp32 pool's."""
    path = str(checkpoint("deepseek_v3"))
    tokens = prompts()[2]
    fp8 = LLM(path, num_blocks=16, kv_cache_dtype="fp8_e4m3", attention_backend=BACKEND)
    whole = _step(fp8, tokens, 0, BACKEND)
    one_by_one = torch.cat([_step(fp8, [token], i, BACKEND) for i, token in enumerate(tokens)])
    torch.testing.assert_close(one_by_one, whole, rtol=1e-4, atol=1e-4)
    full = _step(LLM(path, num_blocks=16, attention_backend=BACKEND), tokens, 0, BACKEND)
    # e4m3 keeps 3 mantissa bits: on this random model's near-flat logits a few argmaxes flip.
    assert (whole - full).abs().mean() < 0.02 * full.abs().max()
    assert (whole.argmax(-1) == full.argmax(-1)).float().mean() > 0.8


def test_a_checkpoint_with_an_mtp_layer_runs_its_main_model(checkpoint, tmp_path):
    """DeepSeek-V3's released checkpoints carry one multi-token-prediction layer (``num_nextn_predict_layers``,
    its weights as layer ``num_hidden_layers``); HF does not run it and neither does the engine."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = checkpoint("deepseek_v3")
    shutil.copytree(source, tmp_path / "mtp")
    config = json.loads((tmp_path / "mtp" / "config.json").read_text())
    (tmp_path / "mtp" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    tensors = load_file(tmp_path / "mtp" / "model.safetensors")
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    save_file({**tensors, **extra, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)},
              tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    ours = LLM(str(tmp_path / "mtp"), num_blocks=16, attention_backend=BACKEND)
    plain = LLM(str(source), num_blocks=16, attention_backend=BACKEND)
    assert ours.generate(prompts()[:1], GREEDY)[0].token_ids == plain.generate(prompts()[:1], GREEDY)[0].token_ids


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_long_contexts_expand_a_chunk_at_a_time_to_the_same_logits(kind, checkpoint):
    """Past ``context_chunk`` tokens a prefill expands its context chunk by chunk, merged by log-sum-exp:
    the same logits as the whole context expanded at once, for a prompt and for a chunk after cached ones."""
    llm = LLM(str(checkpoint(kind)), num_blocks=16, attention_backend=BACKEND)
    tokens = prompts()[3]  # 131 tokens
    whole = _step(llm, tokens, 0, BACKEND)
    llm.engine.runner.model.attention.context_chunk = 24  # not a multiple of the block size
    chunked = _step(llm, tokens, 0, BACKEND)
    after_cached = torch.cat([_step(llm, tokens[:50], 0, BACKEND), _step(llm, tokens[50:], 50, BACKEND)])
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after_cached, whole, rtol=1e-4, atol=1e-4)
