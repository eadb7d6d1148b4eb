"""Random-weight HF checkpoints for reference tests, written with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
    "rope_theta": 500000.0,
}


# Tiny MoE models: hidden 64, 4-8 experts. Qwen3-MoE renormalises its top-k, Qwen2-MoE does not (Mixtral
# always does); Qwen3-MoE's layer 0 is dense (``mlp_only_layers``), Qwen2-MoE's too (``decoder_sparse_step`` 2).
MOE_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1)
MOE_KINDS = ("qwen3_moe", "mixtral", "qwen2_moe")
# Random routers are near-flat, so top-k ties are common; scaled gates make them rare (issue's rule).
GATE_SCALE = 8.0


def _moe_model(kind: str):
    import transformers

    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**MOE_COMMON, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])
        return transformers.Qwen3MoeForCausalLM(config)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**{**MOE_COMMON, "intermediate_size": 48}, num_local_experts=4,
                                            num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen2MoeConfig(**MOE_COMMON, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, decoder_sparse_step=2,
                                         norm_topk_prob=False)
    return transformers.Qwen2MoeForCausalLM(config)


# Tiny DeepSeek models (multi-head latent attention, DeepSeek's MoE): 4 heads of 16 + 8 rotary dims, values
# of 16, a latent of 32 (+ 8), a dense first layer, shared experts, and YaRN with its softmax mscale.
DEEPSEEK_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                       initializer_range=0.1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                       v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       first_k_dense_replace=1)
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
DEEPSEEK_KINDS = ("deepseek_v3", "deepseek_v3_full_q", "deepseek_v2")


def _deepseek_model(kind: str):
    import transformers

    if kind == "deepseek_v3":  # a low-rank query, grouped noaux_tc routing, interleaved rotary, YaRN
        config = transformers.DeepseekV3Config(**DEEPSEEK_COMMON, q_lora_rank=24, n_shared_experts=1, n_group=2,
                                               topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                               rope_interleave=True, rope_parameters=YARN_ROPE)
        return transformers.DeepseekV3ForCausalLM(config)
    if kind == "deepseek_v3_full_q":  # V2-Lite's full-rank query, rotate-half rotary, no YaRN, no renorm
        config = transformers.DeepseekV3Config(**DEEPSEEK_COMMON, q_lora_rank=None, n_shared_experts=2, n_group=4,
                                               topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                                               rope_interleave=False)
        return transformers.DeepseekV3ForCausalLM(config)
    config = transformers.DeepseekV2Config(**DEEPSEEK_COMMON, q_lora_rank=None, n_shared_experts=2,
                                           topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                           routed_scaling_factor=2.0, rope_parameters=YARN_ROPE)
    return transformers.DeepseekV2ForCausalLM(config)


def make_checkpoint(kind: str, path: Path) -> Path:
    """Write a small random checkpoint of ``kind`` to ``path`` and return it."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(**COMMON, sliding_window=48)
        model = transformers.MistralForCausalLM(config)
    elif kind == "llama_bias":  # every projection biased, a vocabulary no rank count divides evenly
        config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 509}, attention_bias=True, mlp_bias=True)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 1}, head_dim=48)
        model = transformers.Qwen3ForCausalLM(config)
    elif kind in MOE_KINDS:
        model = _moe_model(kind)
    elif kind in DEEPSEEK_KINDS:
        model = _deepseek_model(kind)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # HF starts biases at zero, where a bias added twice or never would go unseen
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(GATE_SCALE)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init, where a bias ignored would go unseen
                buffer.normal_(std=0.1)
    model.eval().save_pretrained(path)
    return path


def make_poisoned_checkpoint(path: Path, token_id: int) -> Path:
    """The ``llama`` checkpoint with token ``token_id``'s embedding set to NaN.

    Any sequence holding that token gets NaN logits from then on; others are
    untouched (nothing mixes rows across sequences), which is how a fault
    that belongs to one request looks.
    """
    import transformers

    make_checkpoint("llama", path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[token_id] = float("nan")
    model.save_pretrained(path)
    return path
