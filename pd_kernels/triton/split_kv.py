"""Split-KV (flash-decoding) attention: more programs for few, long sequences.

A decode batch of a few sequences gives the single-pass kernel only
``num_seqs * num_kv_heads`` programs, too few to fill a GPU, each walking a
long context alone. Here each q block's visible keys are cut into
``num_splits`` equal runs of tiles, one program each, and a second kernel
merges the partial softmax results:

    out = sum_s exp2(m_s - M) * acc_s / sum_s exp2(m_s - M) * l_s,   M = max_s m_s

with ``m_s`` the running max (log2 domain), ``l_s`` the sum of exponentials and
``acc_s`` the unnormalised output of split s. The splits are cut in-kernel
from each sequence's actual length, so they stay balanced whatever the
host-side bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_kernels.checks import check_attention_args, check_triton_attention_args
from pd_kernels.triton.launch import check_launchable, is_interpreted, next_power_of_2
from pd_kernels.triton.paged_attention import choose_tiles, launch_paged_attention, padded_head_dim

# Splitting pays only when each split still walks this many keys.
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 16


def choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """How many KV splits ``unified_attention`` uses; 1 means the single-pass kernel.

    Everything here is known on the host: ``max_kv_len`` is the block table's
    capacity (``max_blocks_per_seq * block_size``), an upper bound on every
    sequence's length, and ``num_sms`` is 0 where kernels are interpreted.

    - Only decode-only batches split (``num_tokens == num_seqs``): a prefill
      chunk brings its own q blocks, and its programs outlast any split.
    - Only when the single pass leaves SMs idle: ``num_seqs * num_kv_heads <
      num_sms``.
    - Enough splits to give each SM about two programs, at most
      ``MAX_SPLITS``, and no more than leave ``MIN_KEYS_PER_SPLIT`` keys each
      at the bound.
    """
    if num_tokens != num_seqs or num_sms == 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, MAX_SPLITS, max_kv_len // MIN_KEYS_PER_SPLIT))


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,  # fp32 [num_tokens, num_heads, num_splits, HEAD_DIM_PAD]
    partial_max_ptr,  # fp32 [num_tokens, num_heads, num_splits]
    partial_sum_ptr,  # fp32 [num_tokens, num_heads, num_splits]
    num_heads,
    num_splits,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    valid = (head[:, None] < num_heads) & (splits[None, :] < num_splits)  # [BLOCK_H, SPLITS_PAD]
    partial = (token * num_heads + head[:, None]) * num_splits + splits[None, :]
    m = tl.load(partial_max_ptr + partial, mask=valid, other=float("-inf"))
    l = tl.load(partial_sum_ptr + partial, mask=valid, other=0.0)
    # Some split saw the query's own key, so m_all is finite and empty splits
    # weigh exp2(-inf) = 0. Padding heads are never stored.
    m_all = tl.max(m, axis=1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = tl.exp2(m - m_all[:, None])  # [BLOCK_H, SPLITS_PAD]
    total = tl.sum(l * weight, axis=1)
    acc = tl.load(
        partial_out_ptr + partial[:, :, None] * HEAD_DIM_PAD + dims[None, None, :],
        mask=valid[:, :, None],
        other=0.0,
    )  # [BLOCK_H, SPLITS_PAD, HEAD_DIM_PAD]
    total = tl.where(total == 0.0, 1.0, total)  # padding heads only
    result = tl.sum(acc * weight[:, :, None], axis=1) / total[:, None]  # [BLOCK_H, HEAD_DIM_PAD]
    tl.store(
        out_ptr + token * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=(head[:, None] < num_heads) & (dims[None, :] < HEAD_DIM),
    )


def split_kv_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
    *, num_splits: int, sliding_window: int | None = None, softcap: float | None = None,
    out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """``unified_attention`` with each q block's keys cut into ``num_splits`` runs.

    Correct for any batch (mixed ones included); ``choose_num_splits`` says
    when it is faster. Needs ``num_tokens * num_heads * num_splits *
    head_dim_pad`` fp32 of scratch.
    """
    check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, sliding_window, softcap, out,
                         k_scale, v_scale)
    check_triton_attention_args(q, block_table, out)
    check_launchable(q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    launch_split_kv(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
                    sliding_window, softcap, out, num_splits, k_scale, v_scale)
    return out


def launch_split_kv(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
    sliding_window: int | None, softcap: float | None, out: torch.Tensor, num_splits: int,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """The split-KV launch and merge into ``out``, over arguments ``split_kv_attention`` (or
    ``unified_attention``) has already checked; ``num_splits >= 1``. An FP8 pool's V scale is
    applied to each split's partial output, before the merge."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return
    head_dim_pad = padded_head_dim(head_dim)
    partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
    partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    decode_only = num_tokens == seq_lens.shape[0]
    tiles = choose_tiles(q, num_heads // k_cache.shape[2], decode_only, split=True)
    launch_paged_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
        sliding_window, softcap, out, tiles, partials=(partial_out, partial_max, partial_sum),
        k_scale=k_scale, v_scale=v_scale,
    )
    # One head per program on a GPU; the interpreter merges a token's heads at once.
    block_h = next_power_of_2(num_heads) if is_interpreted(q.device) else 1
    _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out, partial_out, partial_max, partial_sum,
        num_heads, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=next_power_of_2(num_splits),
        BLOCK_H=block_h,
    )
