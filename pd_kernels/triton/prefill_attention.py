"""Paged attention for batches of long prompt chunks, tiled as FlashAttention tiles for Hopper.

``unified_attention`` takes this path when a step holds at least
``PREFILL_PATH_TOKENS`` query tokens beyond one a sequence; decode-only and
small mixed batches keep ``paged_attention``'s kernel, which reads KV at
memory speed. The grid and the rows are that kernel's (its module doc):

    axis 0: q blocks, each BLOCK_Q query tokens of one sequence
    axis 1: KV heads; a program computes every query head of its group

so each K/V tile loaded serves BLOCK_Q * GROUP rows (64 or 128 on a GPU). What
differs is the walk over the keys. The rows of a q block sit at query
positions ``[first, last]``; a key tile is either seen by every row, or cut by
the causal diagonal (or a sliding window's edge):

    keys:   | tile 0 | tile 1 | tile 2 | tile 3 | tile 4 |
    rows:   |<------ every row sees these ----->|<-diag->|
            |        unmasked: no key mask,     | masked |
            |        no causal mask, no load    |        |
            |        masks                      |        |

Unmasked tiles cost two ``tl.dot`` and the online softmax; only the tiles
that straddle ``first`` (and, with a window, ``last - window``) build masks.
Tiles past ``last`` are never visited. K is loaded as a block's contiguous
rows (``[TILE, HEAD_DIM]``, ``head_dim`` innermost, as the pool lays it out)
and transposed in registers for the product, so the loads are 16-byte
vectors and Triton pipelines them ``num_stages`` deep (``cp.async``).

A head dim that is not a power of two runs as two products where two pad
less than one (``head_dim_parts``): 80 as 64 + 16 and 96 as 64 + 32, each
with its own K, V and accumulator columns, the scores summed over both. One
product of 128 would spend 37.5% and 25% of the tensor cores' work on zeros.

Under 16-bit queries, FP8 pages (``KV_FORMAT``) are converted to fp16,
which holds every FP8 value exactly, and both products run in fp16, bf16
queries' too: q is scaled by the softmax scale first (so its magnitude is far
from fp16's limit, and saturated at it) and cast once a program. A bf16
product would need a second conversion of every K and V element (fp16 to
bf16) after the first. fp32 queries keep fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_kernels.triton.fp8_kv import KV_NATIVE, dequantize, hardware_fp8, kv_format, kv_pages, read_scale
from pd_kernels.triton.launch import is_interpreted, next_power_of_2
from pd_kernels.triton.paged_attention import (
    FP16_MAX,
    LOG2E,
    NO_REGISTER_CAP,
    TileConfig,
    _query_rows,
    _tanh,
    find_seq_idx,
    num_q_blocks_bound,
    padded_head_dim,
)

# A step takes this path with at least this many query tokens beyond one a sequence (host-known sizes).
PREFILL_PATH_TOKENS = 128


def takes_prefill_path(num_tokens: int, num_seqs: int) -> bool:
    """Whether ``unified_attention`` runs a batch of ``num_tokens`` query tokens in ``num_seqs`` sequences here."""
    return num_tokens - num_seqs >= PREFILL_PATH_TOKENS


@triton.jit
def _load_tile(cache_ptr, block_id, slot, kv_head, dims, kv_mask, stride_block, stride_slot, stride_head, dtype,
               KV_FORMAT: tl.constexpr, FP8_HW: tl.constexpr):
    """``[TILE, len(dims)]`` of the pages, a block's contiguous rows, converted from FP8 to ``dtype``."""
    tile = tl.load(cache_ptr + block_id[:, None] * stride_block + slot[:, None] * stride_slot
                   + kv_head * stride_head + dims[None, :], mask=kv_mask, other=0)
    if KV_FORMAT != KV_NATIVE:
        tile = dequantize(tile, dtype, KV_FORMAT, FP8_HW)
    return tile


@triton.jit
def _prefill_tile(q, q_hi, m_i, l_i, acc, acc_hi, tile, kv_end, query_pos, block_table_row, k_cache_ptr,
                  v_cache_ptr, kv_head, dims, dim_valid, dims_hi, dim_hi_valid, stride_k_block, stride_k_slot,
                  stride_k_head, stride_v_block, stride_v_slot, stride_v_head, score_scale, softcap, sliding_window,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                  USE_WINDOW: tl.constexpr, KV_FORMAT: tl.constexpr, FP8_HW: tl.constexpr,
                  HEAD_DIM_HI: tl.constexpr):
    """One tile of keys through the online softmax. Unless ``MASKED``, every row sees every key of the tile
    (the caller's promise): no mask is built and no load is masked. With ``HEAD_DIM_HI``, the head dims
    past ``dims`` (``dims_hi``) are products of their own, into the scores and into ``acc_hi``."""
    key_pos = tile * TILE + tl.arange(0, TILE)
    if MASKED:
        key_valid = key_pos < kv_end
        block_id = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        kv_hi_mask = key_valid[:, None] & dim_hi_valid[None, :]
    else:
        block_id = tl.load(block_table_row + key_pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = dim_valid[None, :]
        kv_hi_mask = dim_hi_valid[None, :]
    slot = key_pos % BLOCK_SIZE
    k = _load_tile(k_cache_ptr, block_id, slot, kv_head, dims, kv_mask, stride_k_block, stride_k_slot,
                   stride_k_head, q.dtype, KV_FORMAT, FP8_HW)  # [TILE, HEAD_DIM_LO]
    v = _load_tile(v_cache_ptr, block_id, slot, kv_head, dims, kv_mask, stride_v_block, stride_v_slot,
                   stride_v_head, q.dtype, KV_FORMAT, FP8_HW)

    scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, TILE]
    if HEAD_DIM_HI > 0:
        k_hi = _load_tile(k_cache_ptr, block_id, slot, kv_head, dims_hi, kv_hi_mask, stride_k_block,
                          stride_k_slot, stride_k_head, q.dtype, KV_FORMAT, FP8_HW)  # [TILE, HEAD_DIM_HI]
        scores = tl.dot(q_hi, tl.trans(k_hi), scores, input_precision="ieee")
    scores = scores * score_scale
    if USE_SOFTCAP:
        scores = softcap * _tanh(scores / softcap) * LOG2E
    if MASKED:
        visible = key_pos[None, :] <= query_pos[:, None]
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        # A row that has seen no visible key yet keeps m = -inf; m_safe keeps its exponents at exp2(-inf) = 0.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every row sees every key here
        m_safe = m_new
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    if HEAD_DIM_HI > 0:
        v_hi = _load_tile(v_cache_ptr, block_id, slot, kv_head, dims_hi, kv_hi_mask, stride_v_block,
                          stride_v_slot, stride_v_head, q.dtype, KV_FORMAT, FP8_HW)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p.to(v_hi.dtype), v_hi, input_precision="ieee")
    return m_new, l_i, acc, acc_hi


@triton.jit
def _queries(q_rows, row_valid, dims, dim_valid, softmax_scale, HEAD_DIM: tl.constexpr, HEAD_DIM_LO: tl.constexpr,
             HEAD_DIM_HI: tl.constexpr, BLOCK_M: tl.constexpr, USE_SOFTCAP: tl.constexpr, KV_FORMAT: tl.constexpr):
    """The program's query rows (``q_rows``: each row's first element): ``q`` over ``dims`` and, with
    ``HEAD_DIM_HI``, ``q_hi`` over the head dims after them with its accumulator (else placeholders, never
    read); and the scale the scores leave the products with."""
    q = tl.load(q_rows + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    # Scores leave the product in the log2 domain (or softmax-scaled, for the softcap's tanh).
    qk_scale = softmax_scale if USE_SOFTCAP else softmax_scale * LOG2E
    if KV_FORMAT != KV_NATIVE and q.dtype != tl.float32:  # fp16 products (module doc): q takes the scale
        q = tl.clamp(q.to(tl.float32) * qk_scale, -FP16_MAX, FP16_MAX).to(tl.float16)
        score_scale = 1.0
    else:
        score_scale = qk_scale
    if HEAD_DIM_HI > 0:  # the head dims past HEAD_DIM_LO, a product of their own (``head_dim_parts``)
        dims_hi = HEAD_DIM_LO + tl.arange(0, HEAD_DIM_HI)
        dim_hi_valid = dims_hi < HEAD_DIM
        q_hi = tl.load(q_rows + dims_hi[None, :], mask=row_valid[:, None] & dim_hi_valid[None, :], other=0.0)
        if KV_FORMAT != KV_NATIVE and q_hi.dtype != tl.float32:
            q_hi = tl.clamp(q_hi.to(tl.float32) * qk_scale, -FP16_MAX, FP16_MAX).to(tl.float16)
        acc_hi = tl.zeros([BLOCK_M, HEAD_DIM_HI], dtype=tl.float32)
    else:
        dims_hi, dim_hi_valid, q_hi = dims, dim_valid, q
        acc_hi = tl.zeros([BLOCK_M], dtype=tl.float32)
    return q, q_hi, acc_hi, dims_hi, dim_hi_valid, score_scale


@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    softmax_scale,  # times K's read scale for FP8 pages
    v_scale,  # V's read scale for FP8 pages, else 1
    softcap, sliding_window, num_seqs,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head, stride_block_table,
    HEAD_DIM: tl.constexpr, HEAD_DIM_LO: tl.constexpr, HEAD_DIM_HI: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, KV_FORMAT: tl.constexpr, FP8_HW: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq_idx(cu_seqlens_q_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    token, head, query_pos, row_valid, dims, dim_valid = _query_rows(q_block, q_start, q_len, context_len, kv_head,
                                                                     HEAD_DIM, HEAD_DIM_LO, GROUP, BLOCK_Q, BLOCK_M)
    q, q_hi, acc_hi, dims_hi, dim_hi_valid, score_scale = _queries(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head, row_valid, dims, dim_valid,
        softmax_scale, HEAD_DIM, HEAD_DIM_LO, HEAD_DIM_HI, BLOCK_M, USE_SOFTCAP, KV_FORMAT)

    # The rows' positions: first .. last. Tiles [lo, a) and [b, hi) need masks; [a, b) are seen by every row.
    first = context_len + q_block * BLOCK_Q
    last = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    hi = tl.cdiv(last + 1, TILE)
    b = (first + 1) // TILE
    if USE_WINDOW:
        lo = tl.maximum(first - sliding_window + 1, 0) // TILE
        a = tl.minimum(tl.cdiv(tl.maximum(last - sliding_window + 1, 0), TILE), hi)
    else:
        lo = 0
        a = 0
    b = tl.maximum(tl.minimum(b, hi), a)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_LO], dtype=tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    kv_end = last + 1
    for tile in range(lo, a):  # the window's edge
        m_i, l_i, acc, acc_hi = _prefill_tile(
            q, q_hi, m_i, l_i, acc, acc_hi, tile, kv_end, query_pos, block_table_row, k_cache_ptr, v_cache_ptr,
            kv_head, dims, dim_valid, dims_hi, dim_hi_valid, stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head, score_scale, softcap, sliding_window, BLOCK_SIZE, TILE,
            True, USE_SOFTCAP, USE_WINDOW, KV_FORMAT, FP8_HW, HEAD_DIM_HI)
    for tile in range(a, b):
        m_i, l_i, acc, acc_hi = _prefill_tile(
            q, q_hi, m_i, l_i, acc, acc_hi, tile, kv_end, query_pos, block_table_row, k_cache_ptr, v_cache_ptr,
            kv_head, dims, dim_valid, dims_hi, dim_hi_valid, stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head, score_scale, softcap, sliding_window, BLOCK_SIZE, TILE,
            False, USE_SOFTCAP, USE_WINDOW, KV_FORMAT, FP8_HW, HEAD_DIM_HI)
    for tile in range(b, hi):  # the diagonal
        m_i, l_i, acc, acc_hi = _prefill_tile(
            q, q_hi, m_i, l_i, acc, acc_hi, tile, kv_end, query_pos, block_table_row, k_cache_ptr, v_cache_ptr,
            kv_head, dims, dim_valid, dims_hi, dim_hi_valid, stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head, score_scale, softcap, sliding_window, BLOCK_SIZE, TILE,
            True, USE_SOFTCAP, USE_WINDOW, KV_FORMAT, FP8_HW, HEAD_DIM_HI)
    if KV_FORMAT != KV_NATIVE:
        acc = acc * v_scale
        acc_hi = acc_hi * v_scale
    # Every valid row sees at least the key at its own position, so l_i > 0; padding rows divide by 1.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_rows = out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head
    tl.store(out_rows + dims[None, :], (acc / l_safe).to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])
    if HEAD_DIM_HI > 0:
        tl.store(out_rows + dims_hi[None, :], (acc_hi / l_safe).to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_hi_valid[None, :])


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """(lo, hi): the kernel's head dims as two products of power-of-two widths, ``lo`` then ``hi`` (0: one
    product of ``lo``), where two pad less than one. Head dim 80 is 64 + 16 and 96 is 64 + 32, where one
    product of 128 would waste 37.5% and 25% of the tensor cores' work; 128 and 64 are one product. ``hi``
    is at least 16, the least ``tl.dot`` takes."""
    pad = padded_head_dim(head_dim)
    lo = pad // 2
    hi = next_power_of_2(head_dim - lo) if head_dim > lo else 0
    return (lo, hi) if lo >= 16 and hi >= 16 and lo + hi < pad else (pad, 0)


def prefill_tiles(element_size: int, head_dim: int, group: int, capability: int = 90) -> TileConfig:
    """The GPU tiles for a device of ``capability`` (major * 10 + minor). On sm_90, 16-bit, head dims up to
    128: from ``bench.attention_tiles`` on an H200 (4 x 2,048 tokens, heads 32/8, against SDPA's flash
    backend), among the tiles that compile without spills:

        head dim 64:      128 rows, 64 keys, 8 warps, 2 stages  1.10x  (3 stages: 0.77x)
        head dim 128:      64 rows, 64 keys, 4 warps, 3 stages  1.03x  (128 rows, 8 warps: 0.98-1.00x)
        head dim 80, 96:  128 rows, 64 keys, 8 warps, 2 stages  0.81x at 80 (then padded to 128; 64 rows:
                          0.79x); now two products (``head_dim_parts``), not yet swept

    Elsewhere (sm_80: no wgmma, accumulators and q in registers; head dims over 128) 64 rows and 64 keys
    over 3 stages on 8 warps, 32 keys for head dims over 128 to fit shared memory; fp32 (IEEE products on
    the FMA units) 32 rows and 16 keys: the tiles that compile without spills there."""
    pad = padded_head_dim(head_dim)
    if element_size > 2:
        block_m, tile, num_warps, num_stages = 32, 16, 8, 3
    elif capability >= 90 and pad <= 128:
        block_m, tile, num_warps, num_stages = (64, 64, 4, 3) if head_dim == 128 else (128, 64, 8, 2)
    else:
        block_m, tile, num_warps, num_stages = 64, 32 if pad > 128 else 64, 8, 3
    block_m = max(block_m, next_power_of_2(group))
    return TileConfig(block_m, block_m // group, tile, num_warps, num_stages, max_registers=NO_REGISTER_CAP)


def choose_prefill_tiles(q: torch.Tensor, group: int) -> TileConfig:
    """``prefill_tiles`` on a GPU; in the interpreter, which pays per operation, big tiles."""
    if is_interpreted(q.device):
        block_m = max(128, next_power_of_2(group))
        return TileConfig(block_m, block_m // group, 128, 4, 1)
    major, minor = torch.cuda.get_device_capability(q.device)
    return prefill_tiles(q.element_size(), q.shape[2], group, major * 10 + minor)


def launch_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
    sliding_window: int | None, softcap: float | None, out: torch.Tensor, tiles: TileConfig,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Launch the kernel over arguments already checked by ``check_attention_args``; writes into ``out``.
    ``k_scale``, ``v_scale``: an FP8 pool's scales (``pd_kernels.fp8``)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    fp8_hw = hardware_fp8(q.device)
    dim_lo, dim_hi = head_dim_parts(head_dim)
    grid = (num_q_blocks_bound(num_tokens, num_seqs, tiles.block_q), num_kv_heads)
    _prefill_attention_kernel[grid](
        out, q, kv_pages(k_cache), kv_pages(v_cache), cu_seqlens_q, seq_lens, block_table,
        float(softmax_scale) * read_scale(k_cache.dtype, k_scale, fp8_hw),
        read_scale(v_cache.dtype, v_scale, fp8_hw),
        float(softcap) if softcap is not None else 0.0,
        int(sliding_window) if sliding_window is not None else 0,
        num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_LO=dim_lo,
        HEAD_DIM_HI=dim_hi,
        BLOCK_SIZE=block_size,
        GROUP=num_heads // num_kv_heads,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE=tiles.tile,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None,
        KV_FORMAT=kv_format(k_cache.dtype),
        FP8_HW=fp8_hw,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        maxnreg=tiles.max_registers,
    )
