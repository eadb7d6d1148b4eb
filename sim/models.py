"""Model presets: the ``config.json`` of common checkpoints, for planning without the checkpoint.

Each preset is the checkpoint's own config (the fields the engine reads, as released), so
``pd.model.config.model_config_from_dict`` parses it as it would the checkpoint's; ``model_dir``
writes it where an engine can read it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

MODELS = {
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": 128001},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "eos_token_id": 151643},
    # 128 experts, 8 a token: 30.5B parameters, 3.3B active (both with the embeddings).
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                      "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
                      "eos_token_id": 151645},
    # Multi-head latent attention (a 512-value latent and a 64-value rotary key a token and layer), 256
    # routed experts (8 a token) and one shared expert in each of layers 3-60, dense MLPs in layers 0-2;
    # the released checkpoint's block-FP8 weights: 671B parameters, 37B active (the multi-token
    # prediction layer, num_nextn_predict_layers, is not counted nor run).
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
                    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "hidden_act": "silu",
                    "attention_bias": False, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32,
                                                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                          "original_max_position_embeddings": 4096},
                    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]},
                    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1},
    # MLA with a full-rank q_proj, 64 routed experts (6 a token) and two shared ones in layers 1-26, a
    # dense MLP in layer 0, bf16 weights: 15.7B parameters, 2.4B active.
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
                         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
                         "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
                         "routed_scaling_factor": 1.0, "hidden_act": "silu", "attention_bias": False,
                         "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
                         "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 0.707, "mscale_all_dim": 0.707,
                                          "original_max_position_embeddings": 4096},
                         "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 100000,
                         "eos_token_id": 100001},
}


def model_dir(model: str) -> str:
    """A directory ``LLMEngine`` can read for ``model``: a preset's config.json (written where it differs),
    or ``model`` itself."""
    if model not in MODELS:
        return model
    path = Path(tempfile.gettempdir()) / "pd-sim-models" / model
    path.mkdir(parents=True, exist_ok=True)
    config, text = path / "config.json", json.dumps(MODELS[model])
    if not config.exists() or config.read_text() != text:
        config.write_text(text)
    return str(path)
