"""Unified paged attention: one launch for a mixed batch of prefill chunks and decodes.

The host picks the path from sizes it already knows, so a step never waits
on the device:

- prefill (``prefill_attention``): steps with at least ``PREFILL_PATH_TOKENS``
  query tokens beyond one a sequence, tiled for the tensor cores;
- single pass (``paged_attention``): one program per (q block, KV head), for
  decode-only batches (``decode``) and small mixed ones (``mixed``);
- split-KV (``split_kv``): decode-only batches too small to fill the GPU,
  chosen by ``choose_num_splits``.
"""

from __future__ import annotations

import torch

from pd_kernels.checks import check_attention_args, check_triton_attention_args
from pd_kernels.triton.launch import check_launchable, device_sm_count
from pd_kernels.triton.paged_attention import choose_tiles, launch_paged_attention
from pd_kernels.triton.prefill_attention import choose_prefill_tiles, launch_prefill_attention, takes_prefill_path
from pd_kernels.triton.split_kv import choose_num_splits, launch_split_kv


def unified_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
    *, sliding_window: int | None = None, softcap: float | None = None, out: torch.Tensor | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton twin of ``pd_kernels.reference.unified_attention`` (see ``pd_kernels.unified_attention``).

    Beyond the shared checks, q, out and block_table need a contiguous last axis.
    FP8 pages are read as ``pd_kernels.fp8`` defines (see ``fp8_kv``).
    """
    check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, sliding_window, softcap, out,
                         k_scale, v_scale)
    check_triton_attention_args(q, block_table, out)
    check_launchable(q.device)
    num_tokens, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    max_kv_len = block_table.shape[1] * block_size  # host-known bound on every seq_len
    num_splits = choose_num_splits(num_tokens, num_seqs, num_kv_heads, max_kv_len, device_sm_count(q.device))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_splits > 1:  # the arguments are checked above: launch without checking them again
        launch_split_kv(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
                        sliding_window, softcap, out, num_splits, k_scale=k_scale, v_scale=v_scale)
        return out
    if takes_prefill_path(num_tokens, num_seqs):
        launch_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
                                 sliding_window, softcap, out, choose_prefill_tiles(q, num_heads // num_kv_heads),
                                 k_scale=k_scale, v_scale=v_scale)
        return out
    tiles = choose_tiles(q, num_heads // num_kv_heads, decode_only=num_tokens == num_seqs,
                         kv_fp8=k_cache.dtype != q.dtype and k_cache.element_size() == 1)
    launch_paged_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
        sliding_window, softcap, out, tiles, k_scale=k_scale, v_scale=v_scale,
    )
    return out
