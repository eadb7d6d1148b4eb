"""YaRN rotary tables and MLA's softmax scale against HF ``transformers``' own functions, bit for bit.

Configs go through ``model_config_from_dict`` on a DeepSeek-V3 ``config.json``, so the parse of the
YaRN fields is checked along with the formulas.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from pd.model.config import RopeConfig, model_config_from_dict
from pd.model.rope import attention_factor, cos_sin_cache, inverse_frequencies, softmax_scale

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters, yarn_apply_mscale  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding  # noqa: E402

MAX_POSITIONS = 163840
ORIGINAL_POSITIONS = 4096
# Inside, at and past the original context, up to the last extended position.
POSITIONS = [0, 1, 7, 255, 4095, 4096, 65537, MAX_POSITIONS - 1]

# DeepSeek-V3's own rope_scaling (config.json), then variants covering each branch of HF's formula.
V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": ORIGINAL_POSITIONS,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_CASES = {
    "deepseek_v3": V3_YARN,
    "mscale_ratio": {**V3_YARN, "mscale": 0.707, "mscale_all_dim": 0.8},
    "mscale_all_dim_only": {**V3_YARN, "mscale": None, "mscale_all_dim": 0.707},
    "no_mscale": {key: value for key, value in V3_YARN.items() if not key.startswith("mscale")},
    "attention_factor_given": {**V3_YARN, "attention_factor": 1.25},
    "no_truncate": {**V3_YARN, "truncate": False, "beta_fast": 24, "beta_slow": 2},
    # Correction range past both ends of the rotary dims, so HF's clamp to [0, head_dim - 1] applies.
    "range_clamped": {**V3_YARN, "beta_fast": 1024, "beta_slow": 1e-6},
    "small_factor": {**V3_YARN, "factor": 4.0, "original_max_position_embeddings": MAX_POSITIONS // 4, "mscale": 0.9,
                     "mscale_all_dim": 1.1},
}


def deepseek_v3_dict(rope_scaling: dict, rope_theta: float = 10000.0) -> dict:
    """A small DeepSeek-V3 ``config.json`` (real head shapes, few layers and experts)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 1024,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "max_position_embeddings": MAX_POSITIONS, "rope_theta": rope_theta,
        "rope_scaling": {key: value for key, value in rope_scaling.items() if value is not None},
    }


def hf_and_ours(rope_scaling: dict):
    raw = deepseek_v3_dict(rope_scaling)
    return transformers.DeepseekV3Config(**raw), model_config_from_dict(raw)


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_inverse_frequencies_and_attention_factor_match_hf(case):
    hf_config, config = hf_and_ours(YARN_CASES[case])
    assert config.rope.rope_type == "yarn" and config.head_dim == 64
    hf_inv_freq, hf_factor = _compute_yarn_parameters(hf_config)
    inv_freq = inverse_frequencies(config.rope, config.head_dim)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (32,)
    torch.testing.assert_close(inv_freq, hf_inv_freq, rtol=0, atol=0)
    assert attention_factor(config.rope) == hf_factor


def test_yarn_cases_reach_each_branch():
    """The cases above would not catch a dropped branch unless their outcomes differ."""
    factors = {case: attention_factor(hf_and_ours(scaling)[1].rope) for case, scaling in YARN_CASES.items()}
    assert factors["deepseek_v3"] == 1.0  # equal mscales cancel
    assert factors["mscale_ratio"] == pytest.approx((0.0707 * math.log(40) + 1) / (0.08 * math.log(40) + 1))
    assert factors["no_mscale"] == factors["mscale_all_dim_only"] == pytest.approx(0.1 * math.log(40) + 1)
    assert factors["attention_factor_given"] == 1.25
    truncated = inverse_frequencies(hf_and_ours({**YARN_CASES["no_truncate"], "truncate": True})[1].rope, 64)
    assert not torch.equal(inverse_frequencies(hf_and_ours(YARN_CASES["no_truncate"])[1].rope, 64), truncated)


def test_yarn_factor_derived_from_max_positions_matches_hf():
    """Without ``factor`` both derive it as ``max_position_embeddings / original_max_position_embeddings``
    (HF's config validation demands ``factor``, so HF's function reads a plain config object)."""
    scaling = {key: value for key, value in V3_YARN.items() if key != "factor"}
    config = model_config_from_dict(deepseek_v3_dict({**scaling, "mscale": 0.5}))
    assert config.rope.factor == MAX_POSITIONS / ORIGINAL_POSITIONS
    plain = types.SimpleNamespace(
        rope_parameters={**scaling, "mscale": 0.5, "rope_type": "yarn", "rope_theta": 10000.0, "factor": None},
        head_dim=64, hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS,
        standardize_rope_params=lambda: None,
    )
    hf_inv_freq, hf_factor = _compute_yarn_parameters(plain)
    torch.testing.assert_close(inverse_frequencies(config.rope, 64), hf_inv_freq, rtol=0, atol=0)
    assert attention_factor(config.rope) == hf_factor != 1.0


@pytest.mark.parametrize("case", ["deepseek_v3", "mscale_ratio", "attention_factor_given"])
def test_cos_sin_cache_matches_hf_rotary_embedding(case):
    hf_config, config = hf_and_ours(YARN_CASES[case])
    rotary = DeepseekV3RotaryEmbedding(hf_config)
    positions = torch.tensor([POSITIONS])
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, len(POSITIONS), 64]
    table = cos_sin_cache(config.rope, config.head_dim, MAX_POSITIONS)  # [MAX_POSITIONS, 64]
    assert table.dtype == torch.float32 and table.shape == (MAX_POSITIONS, 64)
    rows = table[POSITIONS]
    # HF repeats each half ([freqs, freqs]); the table stores each once, cos then sin.
    torch.testing.assert_close(rows[:, :32], hf_cos[0, :, :32], rtol=0, atol=0)
    torch.testing.assert_close(rows[:, 32:], hf_sin[0, :, :32], rtol=0, atol=0)
    assert rows[-1, :32].abs().max() == pytest.approx(rotary.attention_scaling, rel=1e-3)


@pytest.mark.parametrize("case", YARN_CASES)
def test_softmax_scale_matches_hf_yarn_apply_mscale(case):
    hf_config, config = hf_and_ours(YARN_CASES[case])
    qk_head_dim = config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim
    assert softmax_scale(config.rope, qk_head_dim) == yarn_apply_mscale(hf_config.rope_parameters, qk_head_dim**-0.5)


def test_softmax_scale_folds_mscale_all_dim_only_when_set():
    _, v3 = hf_and_ours(V3_YARN)
    assert softmax_scale(v3.rope, 192) == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    _, no_mscale = hf_and_ours(YARN_CASES["no_mscale"])
    assert softmax_scale(no_mscale.rope, 192) == 192**-0.5
    assert softmax_scale(RopeConfig(theta=10000.0, mscale_all_dim=1.0), 192) == 192**-0.5


# The tables before YaRN, verbatim: default, linear and llama3 must keep them bit for bit.
def reference_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def reference_cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    inv_freq = reference_inverse_frequencies(rope, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0}
UNSCALED_CASES = {
    "default": LLAMA,
    "linear": {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}


@pytest.mark.parametrize("case", UNSCALED_CASES)
def test_default_linear_llama3_tables_unchanged(case):
    config = model_config_from_dict(UNSCALED_CASES[case])
    assert config.rope.rope_type == case and config.head_dim == 128
    assert attention_factor(config.rope) == 1.0
    assert softmax_scale(config.rope, config.head_dim) == config.head_dim**-0.5
    table = cos_sin_cache(config.rope, config.head_dim, 32768)
    assert torch.equal(table, reference_cos_sin_cache(config.rope, config.head_dim, 32768))
