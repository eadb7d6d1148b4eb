"""Each layer's FP8 KV scales: where they come from, and their digest.

An FP8 KV pool stores ``Q(x / scale)`` with one ``k_scale`` and one
``v_scale`` per layer (``pd_kernels.fp8``). They come from, in this order:

1. a scales file the user names (``EngineConfig.kv_cache_scales``), as
   ``pd.kv_calibrate`` writes it: ``{"k_scale": [...], "v_scale": [...]}``,
   one entry per layer;
2. the checkpoint's own tensors, as vLLM and compressed-tensors name them:
   ``model.layers.<i>.self_attn.k_scale`` and ``.v_scale``, the legacy
   ``.kv_scale`` (both), or ``k_proj.output_scale`` / ``v_proj.output_scale``;
3. otherwise 1.0 for every layer (FP8's range then holds keys and values up
   to 448 for e4m3, which is most models' at their usual magnitudes).

Never a calibration at serve time: a replica's scales must be what its peers
hold (``digest``), so they are fixed before the engine starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

from pd.config import EngineConfig
from pd.model.loader import Checkpoint

Scales = tuple[tuple[float, float], ...]  # per layer: (k_scale, v_scale)

_NAMES = {
    "k": ("self_attn.k_scale", "self_attn.kv_scale", "self_attn.k_proj.output_scale"),
    "v": ("self_attn.v_scale", "self_attn.kv_scale", "self_attn.v_proj.output_scale"),
}


def unit_scales(num_layers: int) -> Scales:
    return ((1.0, 1.0),) * num_layers


def _checked(value: float, where: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: a KV scale must be a finite number > 0, got {value}")
    return float(value)


def from_checkpoint(model_dir: Path, num_layers: int) -> Scales | None:
    """The checkpoint's per-layer scale tensors, or None where it has none; refuses a partial set."""
    try:
        checkpoint = Checkpoint(model_dir)
    except ValueError:  # a GGUF file or another format: no scale tensors
        return None
    with checkpoint:
        found: list[list[float | None]] = [[None, None] for _ in range(num_layers)]
        for layer in range(num_layers):
            for column, kind in enumerate("kv"):
                for suffix in _NAMES[kind]:
                    name = f"model.layers.{layer}.{suffix}"
                    if name in checkpoint:
                        tensor = checkpoint.read(name).float()
                        if tensor.numel() != 1:
                            raise ValueError(f"{name}: a per-tensor KV scale has one element, got shape "
                                             f"{tuple(tensor.shape)}")
                        found[layer][column] = _checked(tensor.item(), name)
                        break
    present = [value is not None for pair in found for value in pair]
    if not any(present):
        return None
    if not all(present):
        missing = [f"layer {i} {'kv'[c]}_scale" for i, pair in enumerate(found) for c, v in enumerate(pair) if v is None]
        raise ValueError(f"{model_dir}: the checkpoint has KV scales for some layers only (missing: "
                         f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
    return tuple((k, v) for k, v in found)


def from_file(path: str | Path, num_layers: int) -> Scales:
    """A scales file: ``{"k_scale": [...], "v_scale": [...]}`` with one entry per layer."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"kv_cache_scales {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(raw, dict) or set(raw) - {"k_scale", "v_scale", "source"} or not {"k_scale", "v_scale"} <= set(raw):
        raise ValueError(f"kv_cache_scales {path}: expected {{'k_scale': [...], 'v_scale': [...]}}, got keys "
                         f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
    columns = []
    for kind in ("k_scale", "v_scale"):
        values = raw[kind]
        if not isinstance(values, list) or len(values) != num_layers:
            raise ValueError(f"kv_cache_scales {path}: {kind} must list {num_layers} numbers, one per layer")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"kv_cache_scales {path}: {kind} holds a value that is not a number")
        columns.append([_checked(float(v), f"kv_cache_scales {path}: {kind}[{i}]") for i, v in enumerate(values)])
    return tuple(zip(*columns))


def resolve(model_dir: Path, num_layers: int, scales_file: str | None) -> tuple[Scales, str]:
    """The scales an FP8 pool uses, and where they came from: ``file``, ``checkpoint`` or ``default``."""
    if scales_file is not None:
        return from_file(scales_file, num_layers), "file"
    found = from_checkpoint(model_dir, num_layers)
    if found is not None:
        return found, "checkpoint"
    return unit_scales(num_layers), "default"


def for_pool(model_dir: Path, num_layers: int, config: EngineConfig) -> tuple[Scales, str]:
    """An engine's scales and their source: ``resolve``'s for an FP8 pool, 1.0 (``default``) for any other."""
    if config.kv_cache_dtype == "auto":
        return unit_scales(num_layers), "default"
    return resolve(model_dir, num_layers, config.kv_cache_scales)


def digest(scales: Scales) -> str:
    """A short digest of the scales' fp32 values: peers whose pools differ in it never exchange bytes."""
    packed = b"".join(struct.pack("<ff", k, v) for k, v in scales)
    return hashlib.blake2b(packed, digest_size=8).hexdigest()
