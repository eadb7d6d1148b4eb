"""Write this step's K/V into their pages of the block-major pool.

One program row per (token, KV head) pair: row r is token r // num_kv_heads,
head r % num_kv_heads. Slot s is offset s % block_size of block s // block_size.
Into an FP8 pool each value is written as its code (``fp8_kv.quantize``), the
same bytes as ``pd_kernels.reference.store_kv`` writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_kernels.checks import PAD_SLOT_ID, check_store_kv_args, check_triton_store_kv_args
from pd_kernels.triton.fp8_kv import KV_NATIVE, kv_format, kv_pages, quantize
from pd_kernels.triton.launch import check_launchable, next_power_of_2, row_block

# The kernel skips every negative slot, which covers the padding value.
assert PAD_SLOT_ID < 0


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_rows,
    num_kv_heads,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token = (rows // num_kv_heads).to(tl.int64)
    head = rows % num_kv_heads
    row_valid = rows < num_rows
    slot = tl.load(slot_mapping_ptr + token, mask=row_valid, other=0).to(tl.int64)
    row_valid = row_valid & (slot >= 0)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]

    key = tl.load(key_ptr + (token * stride_key_token + head * stride_key_head)[:, None] + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + (token * stride_value_token + head * stride_value_head)[:, None] + dims[None, :], mask=mask
    )
    if KV_FORMAT != KV_NATIVE:
        key = quantize(key, k_scale, KV_FORMAT)
        value = quantize(value, v_scale, KV_FORMAT)
    k_dst = block_id * stride_k_block + offset * stride_k_slot + head * stride_k_head
    v_dst = block_id * stride_v_block + offset * stride_v_slot + head * stride_v_head
    tl.store(k_cache_ptr + k_dst[:, None] + dims[None, :], key, mask=mask)
    tl.store(v_cache_ptr + v_dst[:, None] + dims[None, :], value, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Triton twin of ``pd_kernels.reference.store_kv``; negative slots (``PAD_SLOT_ID``) are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim] views with any strides
    but a contiguous last axis; slot_mapping: int32 or int64 [num_tokens].
    """
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_triton_store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    check_launchable(key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    num_rows = num_tokens * num_kv_heads
    if num_rows == 0:
        return
    head_dim_pad = next_power_of_2(head_dim)
    block_rows = row_block(head_dim_pad, key.device)
    _store_kv_kernel[(triton.cdiv(num_rows, block_rows),)](
        key, value, kv_pages(k_cache), kv_pages(v_cache), slot_mapping,
        num_rows, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        float(k_scale), float(v_scale),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_ROWS=block_rows,
        KV_FORMAT=kv_format(k_cache.dtype),
    )
