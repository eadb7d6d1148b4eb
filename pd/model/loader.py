"""Load an HF checkpoint directory (single or sharded safetensors) into ``ModelWeights``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pd.config import DTYPE_NAMES
from pd.model.config import ModelConfig
from pd.model.linear import make_linear
from pd.model.llama import LayerWeights, ModelWeights

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """``"auto"`` takes the checkpoint's dtype (float32 when it names none)."""
    if dtype == "auto":
        dtype = config.torch_dtype if config.torch_dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"model directory {model_dir} has no model.safetensors or model.safetensors.index.json")


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        if not path.is_file():
            raise ValueError(f"safetensors shard {path} is listed in the index but missing")
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"cannot read safetensors file {path}: it is corrupt or truncated ({exc})") from exc
    return tensors


class _Weights:
    """Takes named tensors out of a checkpoint, cast to the model's dtype and device."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.tensors = tensors
        self.dtype = dtype
        self.device = device

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing the weight {name!r}")
        tensor = self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, config implies {shape}")
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(name, shape) if name in self.tensors else None

    def fused(self, names: list[str], shapes: list[tuple[int, ...]], required: bool = True) -> torch.Tensor | None:
        """The named tensors concatenated along dim 0; None only when optional and all absent."""
        parts = [self.optional(n, s) for n, s in zip(names, shapes)]
        if not required and all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            missing = [n for n, p in zip(names, parts) if p is None]
            raise ValueError(f"checkpoint is missing the weights {missing}")
        return torch.cat(parts, dim=0)


def load_weights(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    w = _Weights(read_tensors(Path(model_dir)), dtype, device)
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        layers.append(
            LayerWeights(
                input_norm=w.get(p + "input_layernorm.weight", (h,)),
                qkv_proj=make_linear(
                    w.fused([attn + f"{x}_proj.weight" for x in "qkv"], [(q, h), (kv, h), (kv, h)]),
                    w.fused([attn + f"{x}_proj.bias" for x in "qkv"], [(q,), (kv,), (kv,)], required=False),
                ),
                q_norm=w.get(attn + "q_norm.weight", (hd,)) if config.qk_norm else None,
                k_norm=w.get(attn + "k_norm.weight", (hd,)) if config.qk_norm else None,
                o_proj=make_linear(w.get(attn + "o_proj.weight", (h, q)), w.optional(attn + "o_proj.bias", (h,))),
                post_attention_norm=w.get(p + "post_attention_layernorm.weight", (h,)),
                gate_up_proj=make_linear(
                    w.fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"], [(inter, h), (inter, h)]),
                    w.fused([mlp + "gate_proj.bias", mlp + "up_proj.bias"], [(inter,), (inter,)], required=False),
                ),
                down_proj=make_linear(w.get(mlp + "down_proj.weight", (h, inter)), w.optional(mlp + "down_proj.bias", (h,))),
            )
        )
    embed = w.get("model.embed_tokens.weight", (config.vocab_size, h))
    if config.tie_word_embeddings:
        lm_head = make_linear(embed, None)
    elif "lm_head.weight" in w.tensors:
        lm_head = make_linear(w.get("lm_head.weight", (config.vocab_size, h)), None)
    else:
        raise ValueError("checkpoint is missing the weight 'lm_head.weight' and tie_word_embeddings is false")
    return ModelWeights(embed_tokens=embed, layers=layers, norm=w.get("model.norm.weight", (h,)), lm_head=lm_head)
