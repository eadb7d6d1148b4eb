"""Fused RMSNorm with an optional residual add, one read and one write per tensor.

Rows are the flattened leading axes of ``x`` seen as [outer, inner, hidden]
(inner is 1 for 2-D input), so strided views such as per-head slices of a
fused QKV projection are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_kernels.checks import check_rms_norm_args
from pd_kernels.triton.launch import check_launchable, next_power_of_2, row_block


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,  # contiguous [num_rows, HIDDEN]
    residual_out_ptr,  # contiguous [num_rows, HIDDEN] when HAS_RESIDUAL
    num_rows,
    num_inner,
    eps,
    stride_x_outer,
    stride_x_inner,
    stride_residual_outer,
    stride_residual_inner,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    outer = rows // num_inner
    inner = rows % num_inner
    cols = tl.arange(0, HIDDEN_PAD)
    mask = (rows < num_rows)[:, None] & (cols < HIDDEN)[None, :]
    dense = rows[:, None] * HIDDEN + cols[None, :]

    x = tl.load(x_ptr + (outer * stride_x_outer + inner * stride_x_inner)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + (outer * stride_residual_outer + inner * stride_residual_inner)[:, None] + cols[None, :],
            mask=mask,
            other=0.0,
        )
        # Rounded to x's dtype before the norm, as the reference's x + residual is.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + dense, x, mask=mask)
    hidden = x.to(tl.float32)
    variance = tl.sum(hidden * hidden, axis=1) / HIDDEN
    normed = (hidden * tl.rsqrt(variance + eps)[:, None]).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0)
    out = weight.to(tl.float32)[None, :] * normed.to(tl.float32)
    tl.store(out_ptr + dense, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [outer, inner, hidden], a view where the strides allow it."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def norm_num_warps(hidden_pad: int, block_rows: int) -> int:
    """Warps for a program of ``block_rows`` rows: about 32 fp32 values a thread."""
    return min(16, max(4, hidden_pad * block_rows // 1024))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``pd_kernels.reference.rms_norm``.

    x: [..., hidden] with a contiguous last axis; weight: [hidden]. Returns
    ``normed`` in ``x``'s and ``weight``'s promoted dtype, or with
    ``residual`` ``(normed, x + residual)``; outputs are new contiguous tensors.
    """
    check_rms_norm_args(x, weight, residual)
    check_launchable(x.device)
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    x3 = _as_3d(x)
    r3 = _as_3d(residual) if residual is not None else x3
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows > 0:
        hidden_pad = next_power_of_2(hidden)
        block_rows = row_block(hidden_pad, x.device)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x3, r3, weight, out, residual_out if residual_out is not None else out,
            num_rows, x3.shape[1], float(eps),
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            HIDDEN=hidden,
            HIDDEN_PAD=hidden_pad,
            BLOCK_ROWS=block_rows,
            HAS_RESIDUAL=residual is not None,
            num_warps=norm_num_warps(hidden_pad, block_rows),
        )
    return out if residual_out is None else (out, residual_out)
