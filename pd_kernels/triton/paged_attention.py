"""The paged attention kernel behind both the single-pass and the split-KV path.

Grid, with every size known on the host (no device-to-host sync per step):

    axis 0: q blocks, each BLOCK_Q query tokens of one sequence
    axis 1: KV heads; a program computes every query head of its group
    axis 2: KV splits (1 for the single pass)

A program's tile has BLOCK_M rows (BLOCK_Q * GROUP, padded to a power of two).
Row r is query token r // GROUP of the q block, query head kv_head * GROUP + r % GROUP:

    row:    0    1    ..  G-1    G    G+1  ..   BLOCK_Q*G .. BLOCK_M-1
    token:  t    t        t      t+1  t+1        (padding, masked)
    head:   h    h+1      h+G-1  h    h+1

Sequence i's q blocks are numbered from ``cu_seqlens_q[i] // BLOCK_Q + i``.
Since ``sum_i ceil(q_len_i / BLOCK_Q) <= num_tokens // BLOCK_Q + num_seqs``, a
grid of that many q blocks covers any batch of ``num_tokens`` tokens in
``num_seqs`` sequences. Each program finds its sequence by binary search over
``cu_seqlens_q`` (as vLLM's unified Triton attention does); programs past the
end of their sequence exit at once.

KV positions are walked in tiles of TILE keys, independent of the cache's
block_size: key position p lives in slot p % block_size of block
``block_table[seq, p // block_size]``.

FP8 pages (``KV_FORMAT``, see ``fp8_kv``) are loaded as bytes and converted
q's dtype in registers (by the hardware with ``FP8_HW``); under 16-bit
queries both products run in fp16, bf16 ones too (q scaled by the softmax
scale and cast once: a bf16 product would convert every element twice), and
fp32 queries keep fp32. Their scales never touch an element: the host
folds K's into ``softmax_scale`` and the kernel multiplies the output (or a
split's partial accumulator, which the merge sums linearly) by V's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_kernels.triton.fp8_kv import KV_NATIVE, dequantize, hardware_fp8, kv_format, kv_pages, read_scale
from pd_kernels.triton.launch import is_interpreted, next_power_of_2

# A constexpr: a plain global compiles under the interpreter but is refused by the GPU compiler.
LOG2E = tl.constexpr(1.4426950408889634)
FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def find_seq_idx(cu_seqlens_q_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first q block is at or before ``q_block_id``."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _tanh(x):
    # Saturates to +-1 where exp overflows, instead of inf / inf = nan.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _key_tiles(q_block, q_len, context_len, sliding_window, split, num_splits, BLOCK_Q: tl.constexpr,
               TILE: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT: tl.constexpr):
    """The tiles of keys any row of this q block can see, ``[tile_start, tile_end)`` (this split's share when
    SPLIT), and ``kv_end``, the first key past them."""
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    else:
        kv_start = 0
    tile_start = kv_start // TILE
    tile_end = tl.cdiv(kv_end, TILE)
    if SPLIT:
        tiles_per_split = tl.cdiv(tile_end - tile_start, num_splits)
        tile_start = tile_start + split * tiles_per_split
        tile_end = tl.minimum(tile_start + tiles_per_split, tile_end)
    return tile_start, tile_end, kv_end


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, kv_end, query_pos, block_table_row, k_cache_ptr, v_cache_ptr, kv_head,
                 dims, dim_valid, stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot,
                 stride_v_head, score_scale, softcap, sliding_window, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, KV_FORMAT: tl.constexpr,
                 FP8_HW: tl.constexpr):
    """One tile of keys through the online softmax: the rows' new running max, sum and output."""
    key_pos = tile * TILE + tl.arange(0, TILE)
    key_valid = key_pos < kv_end
    block_id = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    slot = key_pos % BLOCK_SIZE
    v = tl.load(
        v_cache_ptr + block_id[:, None] * stride_v_block + slot[:, None] * stride_v_slot
        + kv_head * stride_v_head + dims[None, :],
        mask=key_valid[:, None] & dim_valid[None, :],
        other=0,
    )  # [TILE, HEAD_DIM_PAD]
    if KV_FORMAT == KV_NATIVE:
        k = tl.load(
            k_cache_ptr + block_id[None, :] * stride_k_block + slot[None, :] * stride_k_slot
            + kv_head * stride_k_head + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0,
        )  # [HEAD_DIM_PAD, TILE]
    else:
        # Bytes loaded as the pool's rows and converted there, 16 a thread: loaded transposed, each
        # thread's operand bytes sat apart in shared memory and were read back one byte at a time.
        k = tl.load(
            k_cache_ptr + block_id[:, None] * stride_k_block + slot[:, None] * stride_k_slot
            + kv_head * stride_k_head + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0,
        )  # [TILE, HEAD_DIM_PAD]
        k = tl.trans(dequantize(k, q.dtype, KV_FORMAT, FP8_HW))
        v = dequantize(v, q.dtype, KV_FORMAT, FP8_HW)

    scores = tl.dot(q, k, input_precision="ieee") * score_scale  # [BLOCK_M, TILE]
    if USE_SOFTCAP:
        scores = softcap * _tanh(scores / softcap) * LOG2E
    visible = key_pos[None, :] <= query_pos[:, None]
    if USE_WINDOW:
        visible = visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
    scores = tl.where(visible, scores, float("-inf"))

    # Online softmax in the log2 domain. A row that has seen no visible key
    # yet keeps m = -inf; m_safe keeps its exponents at exp2(-inf) = 0.
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _store_rows(acc, m_i, l_i, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, token, head, dims,
                row_valid, q_mask, split, num_splits, num_heads, stride_out_token, stride_out_head,
                HEAD_DIM_PAD: tl.constexpr, SPLIT: tl.constexpr):
    """The rows' output: normalised into ``out``, or, when SPLIT, this split's partial max, sum and output."""
    if SPLIT:
        # Empty splits store m = -inf, l = 0, acc = 0; the reduction weighs them 0.
        partial = (token * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(partial_max_ptr + partial, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=row_valid)
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])
    else:
        # Every valid row sees at least the key at its own position, so l_i > 0;
        # padding rows (never stored) divide by 1 instead of 0.
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit
def _query_rows(q_block, q_start, q_len, context_len, kv_head, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """The program's rows (the module docstring's map): each one's token, query head and position, which rows
    and head dims are real."""
    rows = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    query_pos = context_len + q_local  # [BLOCK_M]
    dims = tl.arange(0, HEAD_DIM_PAD)
    return token, head, query_pos, row_valid, dims, dims < HEAD_DIM


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], or unused when SPLIT
    partial_out_ptr,  # fp32 [num_tokens, num_heads, num_splits, HEAD_DIM_PAD] when SPLIT
    partial_max_ptr,  # fp32 [num_tokens, num_heads, num_splits], log2 domain
    partial_sum_ptr,  # fp32 [num_tokens, num_heads, num_splits]
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    softmax_scale,  # times K's read scale for FP8 pages
    v_scale,  # V's read scale for FP8 pages, else 1
    softcap, sliding_window, num_seqs, num_heads,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head, stride_block_table,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, SPLIT: tl.constexpr, KV_FORMAT: tl.constexpr, FP8_HW: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq = find_seq_idx(cu_seqlens_q_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    token, head, query_pos, row_valid, dims, dim_valid = _query_rows(q_block, q_start, q_len, context_len, kv_head,
                                                                     HEAD_DIM, HEAD_DIM_PAD, GROUP, BLOCK_Q, BLOCK_M)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    # Scores leave the product in the log2 domain (or softmax-scaled, for the softcap's tanh). Over FP8 pages
    # 16-bit queries' products run in fp16, which holds every FP8 value: q takes the scale, saturated at fp16's
    # range.
    qk_scale = softmax_scale if USE_SOFTCAP else softmax_scale * LOG2E
    if KV_FORMAT != KV_NATIVE and q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32) * qk_scale, -FP16_MAX, FP16_MAX).to(tl.float16)
        score_scale = 1.0
    else:
        score_scale = qk_scale
    tile_start, tile_end, kv_end = _key_tiles(q_block, q_len, context_len, sliding_window, split, num_splits,
                                              BLOCK_Q, TILE, USE_WINDOW, SPLIT)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    for tile in range(tile_start, tile_end):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, kv_end, query_pos, block_table_row, k_cache_ptr,
                                     v_cache_ptr, kv_head, dims, dim_valid, stride_k_block, stride_k_slot,
                                     stride_k_head, stride_v_block, stride_v_slot, stride_v_head, score_scale,
                                     softcap, sliding_window, BLOCK_SIZE, TILE, USE_SOFTCAP, USE_WINDOW, KV_FORMAT,
                                     FP8_HW)
    if KV_FORMAT != KV_NATIVE:
        acc = acc * v_scale
    _store_rows(acc, m_i, l_i, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, token, head, dims,
                row_valid, q_mask, split, num_splits, num_heads, stride_out_token, stride_out_head, HEAD_DIM_PAD,
                SPLIT)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one attention launch."""

    block_m: int  # rows per program: block_q query tokens x group heads, padded to a power of two
    block_q: int  # query tokens per program
    tile: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # ptxas's cap per thread (Triton's ``maxnreg``); None: ptxas picks


# Tells ptxas it may use every register a thread can have: left to itself it caps some specialisations
# (64-row tiles on sm_80, some split-KV decodes) to fit one more block per SM, and spills to get there.
NO_REGISTER_CAP = 255


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a power of two, and to the 16 that ``tl.dot`` needs at least."""
    return max(16, next_power_of_2(head_dim))


def choose_tiles(q: torch.Tensor, group: int, decode_only: bool, split: bool = False,
                 kv_fp8: bool = False) -> TileConfig:
    """Tile sizes for ``q``'s device, dtype and head_dim.

    The interpreter pays per program and per operation, not per element, so
    it gets the biggest tiles. On a GPU a decode-only batch (one query per
    sequence) gets 16 rows, the smallest ``tl.dot`` accepts, since its extra
    rows would be padding; batches with prefill chunks get 64 rows, so each
    K/V tile loaded serves more queries. Key tiles shrink for fp32 and for
    head_dim over 128 so that the pipelined K/V buffers fit shared memory.
    What ``python -m pd_kernels.aot`` showed about registers (no spills is the
    goal): 64-row tiles take 8 warps, since on 4 their fp32 accumulator and
    scores (64 x 128 and 64 x 64) left a thread 255 registers and spills on
    sm_80; and they, like the split-KV programs (``split``), lift ptxas's
    register cap, which otherwise squeezed some specialisations under 128
    (or 72) registers to fit one more block per SM and spilled to get there.
    That costs nothing to the split-KV path, whose grid is sized to about two
    programs per SM, and leaves 64-row tiles at one block of 8 warps per SM,
    at up to about 230 registers on sm_80 and 180 on sm_90. Single-pass
    decodes, memory-bound, keep ptxas's choice: up to about 150 registers
    (three blocks per SM) over pages of q's dtype, up to about 230 over FP8
    pages on sm_90, whose conversions hold their bytes and halves. All
    pipeline 3 K/V tiles deep (with 2, ptxas spilled a few bytes around some
    decode loops' prologue).
    These GPU choices are untuned; ``python -m bench.kernels`` measures them.
    """
    if is_interpreted(q.device):
        block_m = max(128, next_power_of_2(group))
        return TileConfig(block_m, block_m // group, 256, 4, 1)
    return gpu_tiles(q.element_size(), q.shape[2], group, decode_only, split, kv_fp8)


def gpu_tiles(element_size: int, head_dim: int, group: int, decode_only: bool, split: bool = False,
              kv_fp8: bool = False) -> TileConfig:
    """``choose_tiles`` on a GPU, from the shapes alone (the AOT check compiles exactly these). Decodes over
    FP8 pages (``kv_fp8``) take 128-key tiles: on an H200 (``bench.attention_tiles``, batch 64 x 4,096,
    heads 32/8 x 128) 1.29x the bf16 pages' time, against 0.99x at 64 keys and 0.79x at 256.

    fp32 (IEEE products, on the FMA units: their operands sit in registers) takes 16-key tiles and, with
    prefill chunks, 32 rows: the largest that compile without spills at every head dim, group and arch
    the AOT check builds (32 keys spilled up to 1.2 KB in split-KV decodes on sm_90)."""
    block_m = max(16 if decode_only else 64, next_power_of_2(group))
    tile = 32 if element_size > 2 or padded_head_dim(head_dim) > 128 else 64
    if element_size > 2:
        block_m, tile = max(16 if decode_only else 32, next_power_of_2(group)), 16
    if kv_fp8 and decode_only and tile == 64:
        tile = 128
    uncapped = split or not decode_only or element_size > 2  # fp32: ptxas capped a decode at 80 and spilled
    return TileConfig(block_m, block_m // group, tile, num_warps=4 if decode_only else 8, num_stages=3,
                      max_registers=NO_REGISTER_CAP if uncapped else None)


def num_q_blocks_bound(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid axis 0: an upper bound on the q blocks of any batch of this size (see the module doc)."""
    return num_tokens // block_q + num_seqs


def launch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
    sliding_window: int | None, softcap: float | None, out: torch.Tensor, tiles: TileConfig,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Launch the kernel over arguments already checked by ``check_attention_args``.

    Without ``partials``, writes the attention output into ``out``. With
    ``partials = (partial_out, partial_max, partial_sum)``, shaped
    ``[num_tokens, num_heads, num_splits, head_dim_pad]``,
    ``[num_tokens, num_heads, num_splits]`` twice and contiguous, each of the
    ``num_splits`` programs per q block writes its unnormalised share instead.
    ``k_scale``, ``v_scale``: an FP8 pool's scales (``pd_kernels.fp8``).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    split = partials is not None
    if split:
        partial_out, partial_max, partial_sum = partials
        num_splits = partial_max.shape[2]
    else:
        partial_out = partial_max = partial_sum = out
        num_splits = 1
    grid = (num_q_blocks_bound(num_tokens, num_seqs, tiles.block_q), num_kv_heads, num_splits)
    fp8_hw = hardware_fp8(q.device)
    _paged_attention_kernel[grid](
        out, partial_out, partial_max, partial_sum,
        q, kv_pages(k_cache), kv_pages(v_cache), cu_seqlens_q, seq_lens, block_table,
        float(softmax_scale) * read_scale(k_cache.dtype, k_scale, fp8_hw),
        read_scale(v_cache.dtype, v_scale, fp8_hw),
        float(softcap) if softcap is not None else 0.0,
        int(sliding_window) if sliding_window is not None else 0,
        num_seqs, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=padded_head_dim(head_dim),
        BLOCK_SIZE=block_size,
        GROUP=num_heads // num_kv_heads,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE=tiles.tile,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None,
        SPLIT=split,
        KV_FORMAT=kv_format(k_cache.dtype),
        FP8_HW=fp8_hw,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        maxnreg=tiles.max_registers,
    )
