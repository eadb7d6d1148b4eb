"""Checkpoint formats, config dialects and dtypes."""

from __future__ import annotations

import json

import pytest
import torch

from pd import LLM, SamplingParams
from pd.model.config import model_config_from_dict
from tests.checkpoints import MOE_KINDS

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def test_rope_dialects_agree():
    old = model_config_from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    older = model_config_from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}})
    new = model_config_from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}})
    assert old.rope == older.rope == new.rope
    assert new.rope.rope_type == "llama3" and new.rope.theta == 5e5
    plain = model_config_from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope.rope_type == "default" and plain.rope.theta == 1e4
    with pytest.raises(ValueError, match="dynamic"):
        model_config_from_dict({**BASE, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        model_config_from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_dtype_dialects_and_loose_ends():
    assert model_config_from_dict({**BASE, "torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert model_config_from_dict({**BASE, "dtype": "float16"}).torch_dtype == "float16"
    cfg = model_config_from_dict({**BASE, "eos_token_id": None})
    assert cfg.eos_token_ids == ()
    assert model_config_from_dict({**BASE, "eos_token_id": [5, 6]}).eos_token_ids == (5, 6)
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2
    with pytest.raises(ValueError, match="hidden_size"):
        model_config_from_dict({k: v for k, v in BASE.items() if k != "hidden_size"})


def test_sharded_checkpoint_loads_identically(checkpoint, tmp_path, hf_model):
    model = hf_model(checkpoint("llama"))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert LLM(str(sharded), num_blocks=16).generate(prompt, params)[0].token_ids == (
        LLM(str(checkpoint("llama")), num_blocks=16).generate(prompt, params)[0].token_ids
    )


def test_missing_shard_and_missing_weight_are_named(checkpoint, tmp_path, hf_model):
    sharded = tmp_path / "sharded"
    hf_model(checkpoint("llama")).save_pretrained(sharded, max_shard_size="300KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (sharded / victim).unlink()
    with pytest.raises(ValueError, match="missing"):
        LLM(str(sharded), num_blocks=16)


def test_tied_checkpoint_without_lm_head_weight(checkpoint):
    from safetensors import safe_open

    path = checkpoint("qwen2")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert len(LLM(str(path), num_blocks=16).generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids) == 4


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "llama_bias", *MOE_KINDS])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_track_fp32(dtype, kind, checkpoint, hf_model):
    """Half-precision logits stay close to HF's fp32 logits, teacher-forced on the same prompt, on every
    architecture (and, in tests/pd/test_isa_fallback.py's child, on the AVX2 path)."""
    path = checkpoint(kind)
    llm = LLM(str(path), num_blocks=32, dtype=dtype)
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    [out] = llm.generate([list(range(10, 40))], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens = list(range(10, 40)) + out.token_ids
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([tokens])).logits[0]
    # Each greedy pick is at or near the fp32 argmax at its position.
    for step, token in enumerate(out.token_ids):
        row = logits[29 + step]
        assert row.max() - row[token] < 0.1 * (row.max() - row.min())
