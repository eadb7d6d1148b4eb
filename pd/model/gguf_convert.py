"""A GGUF file's conversion into an HF checkpoint directory (``pd.model.gguf`` runs it once per file content).

llama.cpp permutes the rows of a Llama model's Q and K projections for its
rotary layout (``convert_hf_to_gguf.py``'s ``permute``); they are permuted
back here, as ``transformers`` does. Qwen2 and Qwen3 files are stored
unpermuted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from pd.model.architectures import GGUF_ARCHITECTURES
from pd.model.gguf_tokenizer import gguf_tokenizer

# The tensor types dequantized at load (the ``gguf`` package's numpy dequantizers).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
# Kept in their stored dtype: dequantizing these is exact.
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# GGUF tensor name (after ``blk.{i}.``) -> HF name (after ``model.layers.{i}.``).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Llama 3.1's rope scaling, as llama.cpp stores it: one divisor per rotary frequency (``_llama3_rope``).
ROPE_FREQS = "rope_freqs.weight"
LLAMA3_ORIGINAL_CONTEXT = 8192
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF files of the GGUF file into the existing ``out_dir``."""
    import gguf
    import safetensors.torch

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot read GGUF file {str(gguf_path)!r}: {exc}") from exc
    meta = _Metadata(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {gguf_path.name} has architecture {arch!r}, which is not supported; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    entry = GGUF_ARCHITECTURES[arch]  # pd.model.architectures: the HF family it converts to
    hf_architecture, model_type, permuted = entry.name, arch, entry.gguf_permuted
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.pop(ROPE_FREQS, None)
    for name in tensors:
        if name not in _GLOBAL_TENSORS and _hf_layer_name(name) is None:
            raise ValueError(f"GGUF file {gguf_path.name} has tensor {name!r}, which a {arch} model here has no "
                             f"place for")
    num_heads = meta.int(f"{arch}.attention.head_count")
    num_kv_heads = meta.int(f"{arch}.attention.head_count_kv", num_heads)
    weights = {}
    for name, tensor in tensors.items():
        hf_name = _GLOBAL_TENSORS.get(name) or _hf_layer_name(name)
        weight = _dequantize(tensor, gguf_path)
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            weight = _unpermute(weight, num_heads if ".attn_q." in name else num_kv_heads)
        weights[hf_name] = weight
    config = _hf_config(meta, arch, hf_architecture, model_type, weights)
    if rope_freqs is not None:
        original = meta.int(f"{arch}.rope.scaling.original_context_length", LLAMA3_ORIGINAL_CONTEXT)
        config["rope_scaling"] = _llama3_rope(_dequantize(rope_freqs, gguf_path).double(), config, original,
                                              gguf_path)
    tokenizer, tokenizer_config = gguf_tokenizer(meta, gguf_path)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {key: config[key] for key in ("bos_token_id", "eos_token_id") if config.get(key) is not None})
    safetensors.torch.save_file(weights, str(out_dir / "model.safetensors"),
                                metadata={"format": "pt", "source": gguf_path.name})


class _Metadata:
    """A GGUF file's key-value fields, read by name with a clear error for a missing one."""

    def __init__(self, reader, path: Path):
        self._fields = reader.fields
        self._path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"GGUF file {self._path.name} has no {key!r} metadata")
        return int(value)


def _hf_layer_name(name: str) -> str | None:
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in _LAYER_TENSORS:
        return None
    return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"


def _dequantize(tensor, path: Path) -> torch.Tensor:
    """The tensor in HF's ``[out, in]`` orientation: its stored dtype if a float one, else fp32."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF file {path.name}: tensor {tensor.name!r} is of type {kind}, which is not supported; "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 (the contiguous dim) first
    if kind in _FLOAT_TYPES:
        data = np.asarray(tensor.data)
        if kind == "BF16":
            return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(data.copy()).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
                            ).reshape(shape)


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of a rotary projection ``[num_heads * head_dim, in]``.

    llama.cpp stores each head's rows as pairs ``(r0, r_{d/2}), (r1, r_{d/2+1}), ...``; HF keeps the halves
    apart: ``[r0 .. r_{d/2-1}, r_{d/2} .. r_{d-1}]``.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _hf_config(meta: _Metadata, arch: str, hf_architecture: str, model_type: str,
               weights: dict[str, torch.Tensor]) -> dict:
    hidden = meta.int(f"{arch}.embedding_length")
    num_heads = meta.int(f"{arch}.attention.head_count")
    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    config = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": int(embed.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": meta.int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.int(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.int(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": meta.int(f"{arch}.attention.key_length", hidden // num_heads),
        "hidden_act": "silu",
        "max_position_embeddings": meta.int(f"{arch}.context_length"),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": _stored_dtype(weights),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.get(f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; supported: linear, none")
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    return config


def _llama3_rope(factors: torch.Tensor, config: dict, original: int, path: Path) -> dict:
    """The ``llama3`` rope scaling whose per-frequency divisors are ``factors``, as llama.cpp computed them.

    llama.cpp stores Llama 3.1's rope scaling as those divisors (``rope_freqs.weight``) rather than as its
    parameters. The factor is their largest value; the others are Llama 3.1's (low 1, high 4, over
    ``original``, the metadata's original context length or 8192), kept only if they give back every divisor.
    """
    head_dim, theta = config["head_dim"], config["rope_theta"]
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelens = 2 * math.pi / freqs
    factor = float(factors.max())
    low, high = 1.0, 4.0
    smooth = (original / wavelens - low) / (high - low)
    expected = torch.where(wavelens < original / high, torch.ones_like(wavelens),
                           torch.where(wavelens > original / low, torch.full_like(wavelens, factor),
                                       1 / ((1 - smooth) / factor + smooth)))
    if factors.shape != expected.shape or not torch.allclose(factors, expected, rtol=1e-4, atol=1e-6):
        raise ValueError(f"GGUF file {path.name}: its {ROPE_FREQS} are not Llama 3.1's rope scaling over an "
                         f"original context of {original}; other rope scaling is not supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original, "rope_theta": theta}


def _stored_dtype(weights: dict[str, torch.Tensor]) -> str:
    """What ``dtype: auto`` loads: the matrices' one dtype if they share it (a plain F16 or BF16 file), else fp32."""
    dtypes = {t.dtype for t in weights.values() if t.dim() == 2}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
