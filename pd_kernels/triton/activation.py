"""SiLU-and-mul: ``out = silu(gate) * up`` for ``gate_up = [gate | up]``, one read of each and one write.

Program (row, column block) reads a block of ``gate`` and the matching block
of ``up`` from its row, computes in fp32 and rounds once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_kernels.triton.launch import check_launchable, is_interpreted

# Columns per program: 1,024 on a GPU (4 warps, 8 values a thread); the interpreter pays per program.
GPU_BLOCK = 1024
INTERPRETED_BLOCK = 1 << 14


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [num_rows, 2 * n], last axis contiguous
    out_ptr,  # contiguous [num_rows, n]
    n,
    stride_in,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_block(device: torch.device) -> int:
    return INTERPRETED_BLOCK if is_interpreted(device) else GPU_BLOCK


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``pd_kernels.reference.silu_and_mul``; ``gate_up`` needs a contiguous last axis."""
    check_launchable(gate_up.device)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    num_rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows > 0 and n > 0:
        block = silu_block(gate_up.device)
        _silu_and_mul_kernel[(num_rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), BLOCK=block)
    return out
