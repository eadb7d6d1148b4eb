"""FP8 KV pages: what a stored element means, the same for every backend.

A pool of an FP8 dtype holds ``Q(x / scale)``: the key or value divided by
its layer's per-tensor scale (``k_scale`` or ``v_scale``), saturated to the
format's finite range (so no value becomes NaN or infinite; a NaN stays NaN),
and rounded to the nearest representable value, ties to even, as torch's
cast rounds. Reading a page gives ``float(stored) * scale``. Every backend
stores and reads exactly this: the reference here, the C++ kernels
(``cpu/kv_fp8.h``) and the Triton kernels, which fold the scales into the
softmax scale and the output instead of multiplying every element.

    e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; finite to +-448, one NaN code (S.1111.111)
    e5m2:   1 sign, 5 exponent (bias 15), 2 mantissa bits; finite to +-57344 (fp16's top byte)
"""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The engine's names for them (EngineConfig.kv_cache_dtype), as vLLM spells them.
FP8_NAMES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype: 448 (e4m3fn) or 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def check_scale(name: str, scale: float) -> None:
    """A KV scale is a finite positive number."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}: a KV scale must be a finite number > 0, got {scale!r}")


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in an FP8 page: ``x / scale`` in fp32, saturated to the format's range, rounded."""
    limit = fp8_max(dtype)
    return (x.to(torch.float32) / scale).clamp_(-limit, limit).to(dtype)


def dequantize(pages: torch.Tensor, scale: float) -> torch.Tensor:
    """An FP8 page's values in fp32: ``float(stored) * scale``."""
    values = pages.to(torch.float32)
    return values if scale == 1.0 else values.mul_(scale)
