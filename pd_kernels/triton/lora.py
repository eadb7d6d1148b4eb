"""The multi-LoRA delta (``pd_kernels.lora_delta``): Punica's shrink, then expand, in two kernels.

Every grid is sized from shapes the host knows (rows, slots, columns), never from where the rows of a slot
are, so nothing reads the device back and a decode step captures both launches in a CUDA graph. Each
program takes a block of ``BLOCK_M`` rows and one slot, keeps the rows of its block that carry that slot
(the engine orders rows by request, not by adapter) and returns at once when there are none: rows without
an adapter (``NO_LORA``) belong to no program.

- ``_lora_shrink_kernel``: program (row block, slot, split x column block) multiplies its rows of ``x`` by
  its slot's ``lora_a`` over one split of ``in_features``, into an fp32 partial
  ``[num_splits, num_rows, num_slices * rank]``. The splits (split-K) give a decode batch's few row blocks
  enough programs to fill the GPU; each split stores its own partial, so no atomics, no zeroing.
- ``_lora_expand_kernel``: program (row block, slot, column block) sums the splits' partials of each slice
  its columns meet (fp32, never rounded to the dtype), multiplies them by its slot's ``lora_b`` rows for
  those columns, and adds the result to ``out`` once, rounded once.

::

    x [rows, in] --shrink--> partial [splits, rows, slices * rank] --expand--> out [rows, out] +=
                 lora_a[s]                                          lora_b[s], column o reads slice(o)'s rank

The shrink's products are the dtype's (tensor cores for bf16/fp16, IEEE fp32 for fp32), accumulated in
fp32; the expand's are fp32 (``input_precision="ieee"``): its operand is the fp32 sum, and rank-wide
products are few.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_kernels.checks import NO_LORA
from pd_kernels.triton.launch import check_launchable, device_sm_count, next_power_of_2


@dataclass(frozen=True)
class LoraTiles:
    block_m: int  # rows of a program: every row block is launched once per slot
    shrink_n: int  # columns (of num_slices * rank) of a shrink program
    block_k: int  # in_features a shrink step multiplies
    expand_n: int  # output columns of an expand program
    num_warps: int = 4
    num_stages: int = 3


# On sm_80/sm_90 (pd_kernels.aot): neither kernel spills at ranks 16 and 64, 1 to 3 slices, any dtype.
TILES_16BIT = LoraTiles(16, 64, 64, 64)
TILES_FP32 = LoraTiles(16, 64, 32, 64)
# A row past the end reads as a row without an adapter: no program's slot.
_NO_LORA = tl.constexpr(NO_LORA)
MAX_SPLITS = 16
MIN_SPLIT_STEPS = 4  # BLOCK_K steps a split takes at least


def lora_tiles(element_size: int) -> LoraTiles:
    """The tiles for activations of ``element_size`` bytes (fp32: shorter steps of ``in_features``)."""
    return TILES_FP32 if element_size == 4 else TILES_16BIT


def shrink_block_n(tiles: LoraTiles, t_width: int) -> int:
    """The shrink's column block for ``t_width = num_slices * rank`` columns: all of them up to
    ``tiles.shrink_n`` (``tl.dot`` takes 16 at least)."""
    return min(tiles.shrink_n, max(16, next_power_of_2(t_width)))


def rank_pad(rank: int) -> int:
    return max(16, next_power_of_2(rank))


def choose_num_splits(num_rows: int, in_features: int, t_width: int, tiles: LoraTiles, sm_count: int) -> int:
    """Splits of ``in_features`` for the shrink: enough programs for about two per SM over the row and
    column blocks (a row block holds about one slot's rows in a decode batch), each split at least
    ``MIN_SPLIT_STEPS`` steps of ``BLOCK_K``; 1 where the kernels are interpreted (``sm_count`` 0) or
    there are no rows."""
    if sm_count == 0 or num_rows == 0:
        return 1
    blocks = triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(t_width, shrink_block_n(tiles, t_width))
    most = triton.cdiv(in_features, tiles.block_k * MIN_SPLIT_STEPS)
    return max(1, min(MAX_SPLITS, most, triton.cdiv(2 * sm_count, blocks)))


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_rows, in_features], last axis contiguous
    lora_a_ptr,  # contiguous [num_slots, t_width, in_features]
    row_slots_ptr,  # int32 [num_rows]
    partial_ptr,  # fp32 [num_splits, num_rows, t_width]
    num_rows,
    in_features,
    t_width,  # num_slices * rank
    k_per_split,  # in_features of one split, a multiple of BLOCK_K
    stride_x,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mine = tl.load(row_slots_ptr + rows, mask=rows < num_rows, other=_NO_LORA) == slot
    if tl.sum(mine.to(tl.int32), axis=0) == 0:
        return
    num_col_blocks = tl.cdiv(t_width, BLOCK_N)
    split = tl.program_id(2) // num_col_blocks
    cols = (tl.program_id(2) % num_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < t_width
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + (k_begin + ks)[None, :]
    a_ptrs = (lora_a_ptr + slot.to(tl.int64) * t_width * in_features
              + (cols[None, :] * in_features + (k_begin + ks)[:, None]))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_mask = ks < k_end - k0
        a = tl.load(x_ptrs, mask=mine[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(a_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    partial_rows = (split * num_rows + rows).to(tl.int64)
    tl.store(partial_ptr + partial_rows[:, None] * t_width + cols[None, :], acc,
             mask=mine[:, None] & col_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [num_rows, out_features], last axis contiguous
    lora_b_ptr,  # contiguous [num_slots, out_features, RANK]
    row_slots_ptr,  # int32 [num_rows]
    partial_ptr,  # fp32 [num_splits, num_rows, NUM_SLICES * RANK]
    num_rows,
    out_features,
    num_splits,
    stride_out,
    SLICE_STARTS: tl.constexpr,  # each slice's first output column, ascending from 0
    NUM_SLICES: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    slot = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mine = tl.load(row_slots_ptr + rows, mask=rows < num_rows, other=_NO_LORA) == slot
    if tl.sum(mine.to(tl.int32), axis=0) == 0:
        return
    first_col = tl.program_id(2) * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    js = tl.arange(0, RANK_PAD)
    j_mask = js < RANK
    t_rows = rows.to(tl.int64) * (NUM_SLICES * RANK)
    b_ptrs = lora_b_ptr + slot.to(tl.int64) * out_features * RANK + (cols[None, :] * RANK + js[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.static_range(NUM_SLICES):
        in_slice = col_mask & (cols >= SLICE_STARTS[i])
        slice_end = out_features
        if i + 1 < NUM_SLICES:
            in_slice = in_slice & (cols < SLICE_STARTS[i + 1])
            slice_end = SLICE_STARTS[i + 1]
        if (first_col + BLOCK_N > SLICE_STARTS[i]) & (first_col < slice_end):
            t = tl.zeros((BLOCK_M, RANK_PAD), dtype=tl.float32)  # the slice's t: the splits' partials summed
            t_ptrs = partial_ptr + t_rows[:, None] + (i * RANK + js)[None, :]
            for _ in range(num_splits):
                t += tl.load(t_ptrs, mask=mine[:, None] & j_mask[None, :], other=0.0)
                t_ptrs += num_rows * (NUM_SLICES * RANK)
            b = tl.load(b_ptrs, mask=j_mask[:, None] & in_slice[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(t, b, acc, input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    out_mask = mine[:, None] & col_mask[None, :]
    base = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    slice_starts: tuple[int, ...],
) -> None:
    """Triton twin of ``pd_kernels.reference.lora_delta``."""
    check_launchable(out.device)
    tiles = lora_tiles(out.element_size())
    num_splits = choose_num_splits(out.shape[0], x.shape[1], lora_a.shape[1], tiles, device_sm_count(out.device))
    launch_lora_delta(out, x, lora_a, lora_b, row_slots, tuple(slice_starts), tiles, num_splits)


def launch_lora_delta(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      row_slots: torch.Tensor, slice_starts: tuple[int, ...], tiles: LoraTiles,
                      num_splits: int) -> None:
    """Both launches, with ``in_features`` in at most ``num_splits`` splits (arguments checked by
    ``check_lora_args``)."""
    num_rows, out_features = out.shape
    num_slots, t_width, in_features = lora_a.shape
    rank = lora_b.shape[2]
    if num_rows == 0 or num_slots == 0 or in_features == 0:
        return
    k_per_split = triton.cdiv(triton.cdiv(in_features, tiles.block_k), num_splits) * tiles.block_k
    num_splits = triton.cdiv(in_features, k_per_split)  # none empty: each stores its partial
    partial = torch.empty(num_splits, num_rows, t_width, dtype=torch.float32, device=out.device)
    row_blocks = triton.cdiv(num_rows, tiles.block_m)
    shrink_n = shrink_block_n(tiles, t_width)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    _lora_shrink_kernel[(row_blocks, num_slots, num_splits * triton.cdiv(t_width, shrink_n))](
        x, lora_a, row_slots, partial, num_rows, in_features, t_width, k_per_split, x.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=shrink_n, BLOCK_K=tiles.block_k, **launch)
    _lora_expand_kernel[(row_blocks, num_slots, triton.cdiv(out_features, tiles.expand_n))](
        out, lora_b, row_slots, partial, num_rows, out_features, num_splits, out.stride(0),
        SLICE_STARTS=tuple(slice_starts), NUM_SLICES=len(slice_starts), RANK=rank, RANK_PAD=rank_pad(rank),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.expand_n, **launch)

