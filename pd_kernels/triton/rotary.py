"""Rotate-half (NeoX-style) rotary embedding of q and k in one launch.

Rows are (token, head) pairs, row r being token r // num_heads, head
r % num_heads. The first programs rotate q's rows, the rest k's:

    program: 0 .. num_q_programs-1 | num_q_programs .. end
    rotates: q rows                | k rows

With x = [x1 | x2] split at head_dim / 2 and cos/sin read from the cache row
of the token's position: out = [x1 cos - x2 sin | x2 cos + x1 sin].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_kernels.checks import check_rotary_args
from pd_kernels.triton.launch import check_launchable, next_power_of_2, row_block


@triton.jit
def _rotate_rows(
    src_ptr,
    dst_ptr,  # contiguous [num_tokens, num_heads, 2 * HALF]
    positions_ptr,
    cos_sin_cache_ptr,
    row_block_id,
    num_rows,
    num_heads,
    stride_token,
    stride_head,
    stride_cache_pos,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    rows = (row_block_id * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_valid = rows < num_rows
    token = rows // num_heads
    head = rows % num_heads
    cols = tl.arange(0, HALF_PAD)
    mask = row_valid[:, None] & (cols < HALF)[None, :]
    position = tl.load(positions_ptr + token, mask=row_valid, other=0).to(tl.int64)
    cache_row = cos_sin_cache_ptr + position[:, None] * stride_cache_pos + cols[None, :]
    cos = tl.load(cache_row, mask=mask, other=0.0)
    sin = tl.load(cache_row + HALF, mask=mask, other=0.0)
    src = src_ptr + (token * stride_token + head * stride_head)[:, None] + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + rows[:, None] * (2 * HALF) + cols[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_cache_ptr,
    num_q_programs,
    num_q_rows,
    num_k_rows,
    num_heads,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cache_pos,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_q_programs:
        _rotate_rows(q_ptr, q_out_ptr, positions_ptr, cos_sin_cache_ptr, pid, num_q_rows, num_heads,
                     stride_q_token, stride_q_head, stride_cache_pos, HALF, HALF_PAD, BLOCK_ROWS)
    else:
        _rotate_rows(k_ptr, k_out_ptr, positions_ptr, cos_sin_cache_ptr, pid - num_q_programs, num_k_rows,
                     num_kv_heads, stride_k_token, stride_k_head, stride_cache_pos, HALF, HALF_PAD, BLOCK_ROWS)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``pd_kernels.reference.rotary_embedding``; returns new contiguous (q, k).

    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
    (any strides, contiguous last axis); positions: int [num_tokens];
    cos_sin_cache: fp32 [max_positions, head_dim], cos in the first half, sin in the second.
    """
    check_rotary_args(q, k, positions, cos_sin_cache)
    check_launchable(q.device)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    half_pad = next_power_of_2(half)
    block_rows = row_block(half_pad, q.device)
    num_q_rows, num_k_rows = num_tokens * num_heads, num_tokens * num_kv_heads
    num_q_programs = triton.cdiv(num_q_rows, block_rows)
    grid = (num_q_programs + triton.cdiv(num_k_rows, block_rows),)
    _rotary_kernel[grid](
        q, k, q_out, k_out, positions, cos_sin_cache,
        num_q_programs, num_q_rows, num_k_rows, num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_ROWS=block_rows,
    )
    return q_out, k_out
