"""W8A8 INT8 dense layers: int8 weights with a scale per output channel, activations quantized per token.

``y = (Q(x) @ W_q^T) * a_scale[:, None] * w_scale[None, :] + b``, where ``Q(x)`` is each row of ``x``
divided by ``a_scale = absmax(row) / 127``, rounded to the nearest integer (ties to even) as int8; the
products accumulate in int32. The GEMM is ``torch._int_mm`` (oneDNN's s8s8s32 on CPU, with AVX512-VNNI
where the host has it; cuBLASLt on CUDA). A dynamic per-token scale keeps an outlier token from
costing the others their precision, and per-channel weight scales do the same for outlier output
channels; outlier *input* channels land in every row's absmax, which is what ``test_quant_weights``
bounds. On CPU the GEMM takes about three quarters of the layer's time at 512 rows, the quantization of
the activations and the scaling of the int32 products the rest (``python -m bench.quant``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

INT8_MAX = 127
# A row of zeros gets this scale, so that it quantizes to zeros rather than dividing by zero.
MIN_SCALE = 1e-10
# torch._int_mm on CUDA takes more than 16 rows and row counts, K and N that are multiples of 8.
CUDA_MIN_ROWS = 17
CUDA_MULTIPLE = 8


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x [M, K]`` as int8 and its fp32 scale ``[M, 1]`` (symmetric, absmax / 127)."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).div_(INT8_MAX).clamp_(min=MIN_SCALE)
    # |x / scale| <= 127 up to rounding of the division, so the clamp only guards that last ulp.
    return torch.round(x * scale.reciprocal()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def check_int8_linear_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None) -> None:
    """``x [M, K]`` floating; ``weight [N, K]`` int8; ``weight_scale [N]`` fp32; ``bias [N]`` or None."""
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x: expected a 2-D floating tensor [num_tokens, in_features], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if weight.dim() != 2 or weight.dtype != torch.int8:
        raise ValueError(f"weight: expected a 2-D int8 tensor [out, in], got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight: in_features {weight.shape[1]} differs from x's {x.shape[1]}")
    if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale: expected fp32 [{weight.shape[0]}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias: expected [{weight.shape[0]}], got {tuple(bias.shape)}")
    for name, tensor in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias)):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name}: on {tensor.device}, x on {x.device}")


@functools.cache
def onednn_int8() -> bool:
    """Whether ``torch._int_mm`` reaches oneDNN on this CPU: where ``/proc/cpuinfo`` lists AVX512-VNNI (else a
    plain loop; a host without the file counts as without it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512_vnni" in line.split() for line in lines)


def _int_mm(xq: torch.Tensor, weight: torch.Tensor, fused=None) -> torch.Tensor:
    """``xq [M, K] @ weight[N, K]^T`` in int32; rows padded where CUDA's kernel needs it, and on a CPU without
    oneDNN's int8 path, ``fused``'s (the ``cpu`` backend's) GEMM where there is one."""
    num_rows = xq.shape[0]
    if xq.device.type == "cuda":
        if weight.shape[0] % CUDA_MULTIPLE or weight.shape[1] % CUDA_MULTIPLE:
            raise ValueError(f"weight: torch._int_mm on CUDA needs in and out features that are multiples of "
                             f"{CUDA_MULTIPLE}, got {tuple(weight.shape)}")
        rows = max(CUDA_MIN_ROWS, num_rows)
        rows = -(-rows // CUDA_MULTIPLE) * CUDA_MULTIPLE
        if rows != num_rows:
            xq = torch.nn.functional.pad(xq, (0, 0, 0, rows - num_rows))
        return torch._int_mm(xq, weight.t())[:num_rows]
    if fused is not None and not onednn_int8() and weight.is_contiguous():
        return fused.int8_gemm(xq, weight)
    # oneDNN reads the transposed view of [N, K] as a column-major B directly; at one row this was 4x faster
    # than a contiguous [K, N] copy (AMD EPYC, AVX-512 VNNI), the same from eight rows up.
    return torch._int_mm(xq, weight.t())


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, fused=None) -> torch.Tensor:
    """The W8A8 layer (see the module's doc), in ``x``'s dtype.

    ``fused``: the ``cpu`` backend's extension (``pd_kernels.cpu.build()``), whose ``quantize_rows_int8`` and
    ``scale_int32_rows`` (``cpu/int8.cpp``) take the passes before and after the GEMM, each in one loop, for
    contiguous fp32 ``x`` on CPU; other inputs, or None, take the aten ops, which compute the same numbers (but
    for the bias add, which the compiler may fuse with the scaling into one rounding).
    """
    check_int8_linear_args(x, weight, weight_scale, bias)
    if fused is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and (
            bias is None or bias.dtype == torch.float32):
        xq, scale = fused.quantize_rows_int8(x)
        return fused.scale_int32_rows(_int_mm(xq, weight, fused).contiguous(), scale, weight_scale,
                                      None if bias is None else bias.contiguous())
    xq, scale = quantize_rows_int8(x)
    acc = _int_mm(xq, weight, fused)  # [M, N] int32
    out = torch.mul(acc, scale).mul_(weight_scale)
    if bias is not None:
        out.add_(bias)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def int8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64 from the same quantized rows: what ``int8_linear`` must equal up to
    fp32 rounding of the scaling (int32 accumulation of int8 products is exact at these sizes)."""
    check_int8_linear_args(x, weight, weight_scale, bias)
    xq, scale = quantize_rows_int8(x)
    out = (xq.double() @ weight.double().t()) * scale.double() * weight_scale.double()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
