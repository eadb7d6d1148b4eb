"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over latent pages, the weights absorbed.

Each cached token is one latent row, shared by every query head, both its key (all of it) and its value
(its first ``V_DIM`` values):

    latent row:  | 0 ............ V_DIM-1 | V_DIM ........ V_DIM+ROPE_DIM-1 |
                 | c_kv: key and value    | k_pe: key only (rotated)        |

    scores = q[:, :V_DIM] · c_kvᵀ + q[:, V_DIM:] · k_peᵀ        out = softmax(scores) · c_kv

(DeepSeek-V3: V_DIM 512, the kv_lora_rank; ROPE_DIM 64.) The two halves are two products, since their sum
(576) is no power of two; each is padded to one (``V_PAD``, ``ROPE_PAD``, at least 16 for ``tl.dot``).

Grid, every size known on the host:

    axis 0: query tokens, one each
    axis 1: tiles of BLOCK_H query heads
    axis 2: KV splits (1 for the single pass)

A program's tile is its token's BLOCK_H heads (the M of both products, as in FlashMLA and vLLM's Triton MLA
decode), so each latent tile loaded serves them all, and c_kv's tile, loaded once, is the operand of both
products (transposed for the scores). Every head of a token sees the same keys, its causal prefix
``[0, kv_end)``; a prefill chunk's tokens are programs of their own, each walking its own prefix. Keys are
walked in tiles of TILE, each key found through the block table as in ``paged_attention``. Split-KV, where
``choose_num_splits`` asks for it (decode-only batches that leave SMs idle), cuts a token's tiles into
``num_splits`` runs and merges their partial softmax results with ``split_kv``'s merge kernel (the same
partial layout, ``V_PAD`` wide).

FP8 pages (``KV_FORMAT``) are read as ``paged_attention`` reads them (``fp8_kv``): bytes converted in
registers, by the hardware with ``FP8_HW``; under 16-bit queries both products run in fp16 with q
pre-scaled; the read scale folds into the softmax scale (keys) and the output (values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_kernels.checks import check_latent_attention_args, check_triton_attention_args
from pd_kernels.triton.fp8_kv import KV_NATIVE, dequantize, hardware_fp8, kv_format, kv_pages, read_scale
from pd_kernels.triton.launch import check_launchable, device_sm_count, is_interpreted, next_power_of_2
from pd_kernels.triton.paged_attention import FP16_MAX, LOG2E, NO_REGISTER_CAP, _key_tiles
from pd_kernels.triton.split_kv import _merge_splits_kernel, choose_num_splits


@triton.jit
def _token_seq(cu_seqlens_q_ptr, token, num_seqs):
    """The sequence holding query ``token``: the last whose first token is at or before it (an empty
    sequence is never the last such)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(cu_seqlens_q_ptr + mid) <= token:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _load_rows(row_ptrs, key_valid, dims, DIM: tl.constexpr, PAD: tl.constexpr):
    """``[TILE, PAD]`` of the latent rows at ``row_ptrs``, zero past ``DIM`` and for invalid keys."""
    if DIM == PAD:
        return tl.load(row_ptrs[:, None] + dims[None, :], mask=key_valid[:, None], other=0)
    return tl.load(row_ptrs[:, None] + dims[None, :], mask=key_valid[:, None] & (dims[None, :] < DIM), other=0)


@triton.jit
def _latent_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, V_DIM], or unused when SPLIT
    partial_out_ptr,  # fp32 [num_tokens, num_heads, num_splits, V_PAD] when SPLIT
    partial_max_ptr,  # fp32 [num_tokens, num_heads, num_splits], log2 domain
    partial_sum_ptr,  # fp32 [num_tokens, num_heads, num_splits]
    q_ptr, cache_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    softmax_scale,  # times the pages' read scale
    v_scale,  # the pages' read scale (FP8), else 1
    num_seqs, num_heads,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_slot, stride_block_table,
    V_DIM: tl.constexpr, V_PAD: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
    KV_FORMAT: tl.constexpr, FP8_HW: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq = _token_seq(cu_seqlens_q_ptr, token, num_seqs)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_local = token - q_start
    if q_local >= q_len:  # padding tokens past the batch's last
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len
    tile_start, tile_end, kv_end = _key_tiles(q_local, q_len, context_len, 0, split, num_splits, 1, TILE, False,
                                              SPLIT)

    head_valid = head < num_heads
    v_dims = tl.arange(0, V_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    q_row = q_ptr + token.to(tl.int64) * stride_q_token + head * stride_q_head  # [BLOCK_H]
    q_nope = _load_rows(q_row, head_valid, v_dims, V_DIM, V_PAD)  # [BLOCK_H, V_PAD]
    if ROPE_DIM > 0:
        q_pe = _load_rows(q_row + V_DIM, head_valid, rope_dims, ROPE_DIM, ROPE_PAD)  # [BLOCK_H, ROPE_PAD]
    # Scores leave the products in the log2 domain. Over FP8 pages 16-bit queries' products run in fp16, which
    # holds every FP8 value: q takes the scale, saturated at fp16's range.
    qk_scale = softmax_scale * LOG2E
    score_scale = qk_scale
    if KV_FORMAT != KV_NATIVE and q_nope.dtype != tl.float32:
        q_nope = tl.clamp(q_nope.to(tl.float32) * qk_scale, -FP16_MAX, FP16_MAX).to(tl.float16)
        if ROPE_DIM > 0:
            q_pe = tl.clamp(q_pe.to(tl.float32) * qk_scale, -FP16_MAX, FP16_MAX).to(tl.float16)
        score_scale = 1.0

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, V_PAD], dtype=tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    for tile in range(tile_start, tile_end):
        key_pos = tile * TILE + tl.arange(0, TILE)
        key_valid = key_pos < kv_end
        block_id = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        rows = cache_ptr + block_id * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot  # [TILE]
        c_kv = _load_rows(rows, key_valid, v_dims, V_DIM, V_PAD)  # [TILE, V_PAD]
        if KV_FORMAT != KV_NATIVE:
            c_kv = dequantize(c_kv, q_nope.dtype, KV_FORMAT, FP8_HW)
        scores = tl.dot(q_nope, tl.trans(c_kv), input_precision="ieee")  # [BLOCK_H, TILE]
        if ROPE_DIM > 0:
            k_pe = _load_rows(rows + V_DIM, key_valid, rope_dims, ROPE_DIM, ROPE_PAD)  # [TILE, ROPE_PAD]
            if KV_FORMAT != KV_NATIVE:
                k_pe = dequantize(k_pe, q_pe.dtype, KV_FORMAT, FP8_HW)
            scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision="ieee")
        scores = tl.where(key_valid[None, :], scores * score_scale, float("-inf"))
        # Online softmax in the log2 domain; m_safe keeps a row that has seen no key at exp2(-inf) = 0.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision="ieee")
        m_i = m_new
    if KV_FORMAT != KV_NATIVE:
        acc = acc * v_scale

    if SPLIT:
        # Empty splits store m = -inf, l = 0, acc = 0; the merge weighs them 0.
        partial = (token.to(tl.int64) * num_heads + head) * num_splits + split  # [BLOCK_H]
        tl.store(partial_max_ptr + partial, m_i, mask=head_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=head_valid)
        tl.store(partial_out_ptr + partial[:, None] * V_PAD + v_dims[None, :], acc, mask=head_valid[:, None])
    else:
        # Every token sees at least its own key, so l_i > 0; padding heads (never stored) divide by 1.
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_row = out_ptr + token.to(tl.int64) * stride_out_token + head * stride_out_head
        tl.store(out_row[:, None] + v_dims[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=head_valid[:, None] & (v_dims[None, :] < V_DIM))


@dataclass(frozen=True)
class LatentTiles:
    """Tile sizes of one latent attention launch."""

    block_h: int  # query heads per program (the products' M), a power of two >= 16
    tile: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # ptxas's cap per thread (Triton's ``maxnreg``); None: ptxas picks


def padded_dim(dim: int) -> int:
    """A part of the latent row rounded up to a power of two, and to the 16 that ``tl.dot`` needs at least."""
    return max(16, next_power_of_2(dim))


def choose_latent_tiles(q: torch.Tensor) -> LatentTiles:
    """Tile sizes for ``q``'s device, dtype and heads. The interpreter pays per program and per operation, not
    per element: it takes every head and 256 keys a program."""
    if is_interpreted(q.device):
        return LatentTiles(padded_dim(q.shape[1]), 256, 4, 1)
    return gpu_latent_tiles(q.element_size(), q.shape[1])


def gpu_latent_tiles(element_size: int, num_heads: int) -> LatentTiles:
    """``choose_latent_tiles`` on a GPU, from the shapes alone (the AOT check compiles exactly these).

    What ``python -m pd_kernels.aot`` showed at DeepSeek-V3's row (512 + 64), no spills being the goal:

    - 16-bit queries: 16 heads a program (the smallest M of ``tl.dot``, and V3's heads per rank at TP 8),
      tiles of 32 keys, 8 warps, 3 stages, ptxas uncapped: 146 to 160 registers over bf16/fp16 pages, 180
      to 251 over FP8 pages, whose bytes and halves are converted in registers (on 4 warps FP8 pages
      spilled up to 1 KB; left to itself, ptxas capped native pages at 128 on sm_90 and spilled). c_kv's
      tile (32 KB) sits in shared memory once, the operand of both products. From 32 heads (TP 4 and
      wider), 32 heads a program, so that each latent tile loaded serves twice the heads: 203 to 217
      registers, 239 to 255 over FP8 pages; 64 heads spilled.
    - fp32 (IEEE products on the FMA units): 16 heads, 16 keys, 8 warps, one stage: 149 to 174
      registers; 2 stages spilled 24 bytes, 4 warps hundreds.

    These GPU choices are untuned.
    """
    if element_size > 2:
        return LatentTiles(16, 16, num_warps=8, num_stages=1, max_registers=NO_REGISTER_CAP)
    block_h = 32 if num_heads >= 32 else 16
    return LatentTiles(block_h, 32, num_warps=8, num_stages=3, max_registers=NO_REGISTER_CAP)


def latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, softmax_scale: float, *, v_dim: int, out: torch.Tensor | None = None,
                     scale: float = 1.0) -> torch.Tensor:
    """Triton twin of ``pd_kernels.reference.latent_attention`` (see ``pd_kernels.latent_attention``): a single
    pass, or split-KV (``choose_num_splits``) where the batch leaves SMs idle.

    Beyond the shared checks, q, out and block_table need a contiguous last axis."""
    check_latent_attention_args(q, latent_cache, cu_seqlens_q, seq_lens, block_table, v_dim, out, scale)
    check_triton_attention_args(q, block_table, out)
    check_launchable(q.device)
    tiles = choose_latent_tiles(q)
    max_kv_len = block_table.shape[1] * latent_cache.shape[1]  # host-known bound on every seq_len
    num_splits = choose_num_splits(q.shape[0], seq_lens.shape[0], triton.cdiv(q.shape[1], tiles.block_h),
                                   max_kv_len, device_sm_count(q.device))
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    launch_latent_attention(q, latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, v_dim, scale, out,
                            tiles, num_splits)
    return out


def split_latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float, *, v_dim: int,
                           num_splits: int, out: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``latent_attention`` with each token's keys cut into ``num_splits`` runs, whatever the batch. Needs
    ``num_tokens * num_heads * num_splits * v_pad`` fp32 of scratch."""
    check_latent_attention_args(q, latent_cache, cu_seqlens_q, seq_lens, block_table, v_dim, out, scale)
    check_triton_attention_args(q, block_table, out)
    check_launchable(q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    tiles = choose_latent_tiles(q)
    launch_latent_attention(q, latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, v_dim, scale, out,
                            tiles, num_splits)
    return out


def launch_latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float, v_dim: int,
                            scale: float, out: torch.Tensor, tiles: LatentTiles, num_splits: int) -> None:
    """The kernel (and with ``num_splits > 1`` the merge) into ``out``, over checked arguments."""
    num_tokens, num_heads, latent_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    v_pad, rope_dim = padded_dim(v_dim), latent_dim - v_dim
    split = num_splits > 1
    if split:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, v_pad, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out
    fp8_hw = hardware_fp8(q.device)
    pages_scale = read_scale(latent_cache.dtype, scale, fp8_hw)
    grid = (num_tokens, triton.cdiv(num_heads, tiles.block_h), num_splits)
    _latent_attention_kernel[grid](
        out, partial_out, partial_max, partial_sum,
        q, kv_pages(latent_cache), cu_seqlens_q, seq_lens, block_table,
        float(softmax_scale) * pages_scale, pages_scale, num_seqs, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        V_DIM=v_dim, V_PAD=v_pad, ROPE_DIM=rope_dim, ROPE_PAD=padded_dim(rope_dim),
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_H=tiles.block_h, TILE=tiles.tile, SPLIT=split,
        KV_FORMAT=kv_format(latent_cache.dtype), FP8_HW=fp8_hw,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, maxnreg=tiles.max_registers,
    )
    if split:
        # One head per program on a GPU; the interpreter merges a token's heads at once.
        block_h = next_power_of_2(num_heads) if is_interpreted(q.device) else 1
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out, partial_out, partial_max, partial_sum, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=v_dim, HEAD_DIM_PAD=v_pad, SPLITS_PAD=next_power_of_2(num_splits), BLOCK_H=block_h,
        )
