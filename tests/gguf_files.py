"""Small GGUF files for tests, written with the ``gguf`` package's own writer from random HF checkpoints.

Each matrix is stored in the quant type asked for, norms in F32, as llama.cpp's converter lays them out:
a Llama model's Q and K rows permuted for its rotary layout, names in its scheme, the tokenizer in
``tokenizer.ggml.*`` metadata. The types the ``gguf`` package can quantize are quantized from the weights;
the K-quants (which it only dequantizes) are random blocks with bounded scales, so both readers see the same
bytes either way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# The random checkpoints' shape: rows of 256, so the K-quants' 256-value blocks fit every matrix.
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.05)
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
            "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}")

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def make_hf_model(kind: str, path: Path) -> Path:
    """A random HF checkpoint of ``kind`` (llama, llama3, llama3_short, qwen2, qwen3) in the GGUF test shape."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, rope_theta=10000.0))
    elif kind in ("llama3", "llama3_short"):  # Llama 3.1's rope scaling: llama.cpp stores it as rope_freqs.weight
        # Over Llama 3.1's original context (8192) it barely turns a short prompt's rotations; over 64, it does.
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192 if kind == "llama3" else 64, "rope_theta": 500000.0}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, rope_parameters=rope))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True))
    elif kind == "qwen3":  # head_dim 128: transformers' GGUF reader takes Qwen3's default, not key_length
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=128))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
            elif name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
    model.eval().save_pretrained(path)
    return path


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py): each head's two rotary halves interleaved by rows."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _llama3_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3.1 rope scaling (convert_hf_to_gguf.py's LlamaModel)."""
    import math

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _random_k_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K or Q6_K bytes for ``[rows, cols]`` whose super-block scales are small, finite fp16 values."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d and dmin, two fp16, lead the block
        blocks[..., 0:4] = np.array([0.0004, 0.0004], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: d, one fp16, ends it
        blocks[..., -2:] = np.array([0.0002], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _encode(array: np.ndarray, type_name: str, rng: np.random.Generator):
    """``(data, raw_dtype)`` for GGUFWriter.add_tensor."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32" or array.ndim == 1:
        return array.astype(np.float32), None
    if type_name == "F16":
        return array.astype(np.float16), None
    if type_name in ("Q4_K", "Q6_K"):
        return _random_k_blocks(qtype, *array.shape, rng), qtype
    return quantize(array.astype(np.float32), qtype), qtype


def write_gguf(hf_dir: Path, out: Path, type_name: str, with_tokenizer: bool = True) -> Path:
    """The checkpoint in ``hf_dir`` as a GGUF file at ``out``, its matrices in ``type_name``."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
        config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta") or rope.get("rope_theta", 1e4)
    writer.add_rope_freq_base(theta)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(rope, theta, head_dim))
        if rope["original_max_position_embeddings"] != 8192:  # llama.cpp's files of Llama 3.1 have no such key
            writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                              rope["original_max_position_embeddings"])
    writer.add_vocab_size(config["vocab_size"])
    if with_tokenizer:
        _add_tokenizer(writer, config["vocab_size"])
    rng = np.random.default_rng(0)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{_LAYER_NAMES[rest]}"
            if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                array = _permute(array, heads if "q_proj" in rest else kv_heads)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if type_name == "BF16" and array.ndim == 2:
            writer.add_tensor(gguf_name, torch.from_numpy(array).bfloat16().view(torch.int16).numpy().view(np.uint16),
                              raw_shape=array.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
            continue
        data, raw_dtype = _encode(array, type_name, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, vocab_size: int) -> None:
    """The built-in model's byte-level BPE at ``vocab_size`` ids, special tokens (CONTROL) last."""
    from pd.model.builtin import BOS_TOKEN, EOT_TOKEN, build_tokenizer

    tokenizer = build_tokenizer(vocab_size)
    spec = json.loads(tokenizer.to_str())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in spec["added_tokens"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[BOS_TOKEN])
    writer.add_eos_token_id(vocab[EOT_TOKEN])
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)
