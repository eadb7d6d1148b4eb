"""Dense layers of 8-bit checkpoints, in the form the device runs fastest.

- INT8 W8A8 (per-channel weights, per-token activations): ``Int8Linear``, an int8 GEMM with int32
  accumulation (``pd_kernels.int8``, ``torch._int_mm``) on CPU and CUDA, the activations' quantization and the
  output's scaling in one C++ loop each where the ``cpu`` backend runs. The weights stay int8: a quarter of
  fp32's memory.
- FP8 W8A8 on CUDA: ``Fp8Linear``, the Triton scaled product (``pd_kernels.triton.scaled_mm``) of the FP8
  weight and the activations quantized to FP8 per token (per token and 128 columns for block weights).
- FP8 on CPU: no CPU here multiplies FP8, so the weight is dequantized once, at load, to the engine's
  dtype and runs as an ordinary ``Linear``: exactly the unquantized model's memory and speed, with the
  FP8 rounding of the weights (and none of the activations) in its numbers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

import pd_kernels.cpu
from pd.model.linear import Linear, make_linear
from pd.model.quant_scheme import WeightFormat
from pd.model.quant_weights import QuantizedWeight, dequantize
from pd_kernels.int8 import int8_linear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Int8Linear:
    """``y = W8A8(x) + b`` for ``x [num_tokens, in_features]`` (see ``pd_kernels.int8``)."""

    weight: torch.Tensor  # int8 [out, in]
    weight_scale: torch.Tensor  # fp32 [out]
    bias: torch.Tensor | None  # [out]
    packed: bool = False  # the model pads rows only for oneDNN-packed layers
    fused: object | None = None  # the cpu backend's extension: its loops around the GEMM (pd_kernels.int8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.weight_scale, self.bias, self.fused)


@dataclass(frozen=True)
class Fp8Linear:
    """``y = (Q(x) @ W^T) * scales + b`` on CUDA, ``Q`` FP8 per token (and per 128 columns for blocks)."""

    weight: torch.Tensor  # float8_e4m3fn [out, in]
    weight_scale: torch.Tensor  # fp32 [out], or [ceil(out / block_rows), ceil(in / 128)]
    block_rows: int | None  # None: per-channel scales; else rows per block scale (1 or 128)
    bias: torch.Tensor | None
    packed: bool = False
    # The product (pd_kernels.triton.scaled_mm's signature); None: the Triton kernel. Its torch reference
    # computes the same layer on a CPU (bench.quant_accuracy's FP8 W8A8 figures).
    mm: Callable | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pd_kernels.triton.scaled_mm import GROUP_K, quantize_fp8_rows, scaled_mm

        xq, x_scale = quantize_fp8_rows(x, GROUP_K if self.block_rows is not None else None)
        return (self.mm or scaled_mm)(xq, self.weight, x_scale, self.weight_scale, self.block_rows, self.bias,
                                      x.dtype)


QuantLinear = Linear | Int8Linear | Fp8Linear
# FP8 products (and Triton's e4m3) start at Ada and Hopper; an A100 (8.0) runs FP8 weights dequantized.
FP8_MIN_CAPABILITY = (8, 9)


def make_quantized_linear(q: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, form: str,
                          few_rows: bool) -> QuantLinear:
    """The layer that runs ``q`` (already on its device) for activations of ``dtype``; ``form`` and
    ``few_rows`` are those of ``make_linear``, for an FP8 weight that a CPU runs dequantized."""
    device = q.weight.device
    if q.format is WeightFormat.INT8_CHANNEL:
        # few_rows means the cpu backend runs the model, its extension built (pd.model.linear.make_linear)
        fused = pd_kernels.cpu.build() if few_rows and device.type == "cpu" else None
        return Int8Linear(q.weight, q.scale, bias, fused=fused)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY:
        return fp8_linear(q, bias)
    if device.type == "cuda":
        _warn_once(f"FP8 weights on a GPU of compute capability {torch.cuda.get_device_capability(device)}: it "
                   f"has no FP8 products (they need {FP8_MIN_CAPABILITY}), so they are dequantized to {dtype} at "
                   "load: the unquantized model's memory and speed")
    return make_linear(dequantize(q, dtype), bias, form, few_rows)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def fp8_linear(q: QuantizedWeight, bias: torch.Tensor | None, mm: Callable | None = None) -> Fp8Linear:
    """``q`` (FP8) as a W8A8 layer: the CUDA path's, or with the product ``mm``."""
    block_rows = q.block_rows if q.format is WeightFormat.FP8_BLOCK else None
    return Fp8Linear(q.weight, q.scale, block_rows, None if bias is None else bias.contiguous(), mm=mm)


def held_bytes(layer: QuantLinear) -> int:
    """The bytes of weights and scales ``layer`` holds (the few-row panels of an fp32 layer not counted)."""
    tensors = [layer.weight, layer.bias, getattr(layer, "weight_scale", None)]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
