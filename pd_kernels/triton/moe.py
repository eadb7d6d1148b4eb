"""Fused MoE: token slots sorted by expert and padded to the row tile, then two grouped GEMMs.

``moe_align`` (host side, torch ops, no device sync) sorts the ``T * k``
slots by expert, pads each expert's run to a multiple of ``BLOCK_M`` (as
vLLM's ``moe_align_block_size``), and names each tile of ``BLOCK_M`` rows its
expert (-1 for the tiles past the end, which return at once).

- ``_moe_gate_up_kernel``: program (row tile, column tile of ``I``) gathers
  its slots' tokens from ``hidden``, multiplies them by its expert's gate and
  up rows, and stores ``silu(gate) * up`` at the sorted rows of an
  intermediate ``[padded slots, I]``: the activation is fused into the GEMM.
- ``_moe_down_kernel``: program (row tile, column tile of ``H``) multiplies
  those rows by its expert's ``w2``, scales each row by its slot's routed
  weight and stores it at the slot's own row of ``[T * k, H]``.

The sum over each token's ``k`` slots is one ``sum`` over that view. Both
kernels accumulate in fp32 and round once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pd_kernels.triton.launch import check_launchable, is_interpreted


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # slot rows per tile: each expert's run is padded to a multiple of it
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# On sm_80/sm_90 (pd_kernels.aot, bf16/fp16): neither spills. BLOCK_K 64 spilled (gate/up holds two weight tiles),
# and so did 64-row tiles on 4 warps. fp32 decodes take 8 warps: on 4 the gate/up kernel's two fp32 weight
# tiles needed 255 registers and spilled 144-152 bytes; on 8, 120-154 and none.
DECODE_TILES = MoeTiles(16, 64, 32, num_warps=4)
DECODE_TILES_FP32 = MoeTiles(16, 64, 32, num_warps=8)
PREFILL_TILES = MoeTiles(64, 64, 32, num_warps=8)


def decode_tiles(dtype: torch.dtype) -> MoeTiles:
    """The decode path's tiles for weights of ``dtype``."""
    return DECODE_TILES_FP32 if dtype == torch.float32 else DECODE_TILES


def moe_tiles(num_slots: int, num_experts: int, device: torch.device, dtype: torch.dtype) -> MoeTiles:
    """Tiles for ``num_slots`` routed slots over ``num_experts``: small row tiles when each expert gets few
    rows (decode), larger ones for prefill batches. The interpreter takes large tiles (it pays per program)."""
    if is_interpreted(device):
        return MoeTiles(16, 64, 64)
    return decode_tiles(dtype) if num_slots <= 4 * num_experts * DECODE_TILES.block_m else PREFILL_TILES


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_slots, block_experts)``: the slots in expert order, each expert's run padded to ``block_m``
    with the sentinel ``T * k``; and each tile's expert, -1 past the last run.

    Sized for the worst case (every expert padded), so nothing waits for the device to learn the total, and
    no op reads the device back: decode steps replay it in CUDA graphs (``pd.engine.cuda_graphs``).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    order = torch.argsort(flat, stable=True)
    # Not bincount: on CUDA it reads the largest id back to size its output, a host sync a CUDA graph
    # cannot capture.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    capacity = triton.cdiv(num_slots + num_experts * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_slots[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)
    block_experts.masked_fill_(block_experts >= num_experts, -1)  # not a boolean index: that syncs
    return sorted_slots, block_experts


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr,  # [T, H], last axis contiguous
    w13_ptr,  # contiguous [E, 2I, H]: gate rows, then up rows
    inter_ptr,  # contiguous [padded slots, I]
    sorted_slots_ptr,  # int32 [padded slots]
    block_experts_ptr,  # int32 [tiles]
    num_slots,
    top_k,
    hidden_size,
    inter_size,
    stride_hidden,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    tokens = (slots // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter_size
    ks = tl.arange(0, BLOCK_K)
    # Pointers made once and advanced by BLOCK_K: offsets inside one expert's weights fit in int32.
    a_ptrs = hidden_ptr + tokens[:, None] * stride_hidden + ks[None, :]
    gate_ptrs = w13_ptr + expert * 2 * inter_size * hidden_size + (cols[None, :] * hidden_size + ks[:, None])
    up_ptrs = gate_ptrs + inter_size * hidden_size
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_mask = ks < hidden_size - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate = tl.dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), gate, input_precision="ieee")
        up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), up, input_precision="ieee")
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + rows[:, None].to(tl.int64) * inter_size + cols[None, :],
             out.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr,  # contiguous [padded slots, I]
    w2_ptr,  # contiguous [E, H, I]
    topk_weights_ptr,  # [T * k], any float dtype
    out_ptr,  # contiguous [T * k, H]
    sorted_slots_ptr,
    block_experts_ptr,
    num_slots,
    hidden_size,
    inter_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows[:, None].to(tl.int64) * inter_size + ks[None, :]
    w_ptrs = w2_ptr + expert * hidden_size * inter_size + (cols[None, :] * inter_size + ks[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_mask = ks < inter_size - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0), acc,
                     input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    routed = tl.load(topk_weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)
    acc = acc * routed[:, None]
    tl.store(out_ptr + slots[:, None].to(tl.int64) * hidden_size + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of ``pd_kernels.reference.fused_moe``."""
    check_launchable(hidden.device)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    inter_size, num_slots = two_i // 2, num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(hidden)
    tiles = moe_tiles(num_slots, num_experts, hidden.device, w13.dtype)
    sorted_slots, block_experts = moe_align(topk_ids, num_experts, tiles.block_m)
    inter = torch.empty(sorted_slots.numel(), inter_size, dtype=hidden.dtype, device=hidden.device)
    options = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
               "num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    _moe_gate_up_kernel[(block_experts.numel(), triton.cdiv(inter_size, tiles.block_n))](
        hidden, w13, inter, sorted_slots, block_experts, num_slots, top_k, hidden_size, inter_size,
        hidden.stride(0), **options)
    slot_out = torch.empty(num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _moe_down_kernel[(block_experts.numel(), triton.cdiv(hidden_size, tiles.block_n))](
        inter, w2, topk_weights.reshape(-1).contiguous(), slot_out, sorted_slots, block_experts, num_slots,
        hidden_size, inter_size, **options)
    return slot_out.view(num_tokens, top_k, hidden_size).sum(dim=1)
