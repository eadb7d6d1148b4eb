"""The torch reference against dense causal SDPA, so the Triton tests compare to ground truth.

Each sequence's keys are contiguous pages of a contiguous cache. The dense
side runs causal attention over all ``kv_len`` positions and keeps the last
``q_len`` rows, which is what the reference must return for those queries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pd_kernels import reference


def _dense_attention(q, k, v, scale, sliding_window, softcap):
    """q: [heads, n, d]; k, v: [kv_heads, n, d] -> [heads, n, d], causal over n positions."""
    n = q.shape[1]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    if sliding_window is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    if sliding_window is not None:
        mask &= torch.ones(n, n, dtype=torch.bool).triu(-(sliding_window - 1))
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scale / softcap)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize(
    "heads, kv_heads, sliding_window, softcap",
    [(4, 4, None, None), (8, 2, None, None), (6, 3, 7, None), (4, 2, 5, 3.0)],
    ids=["mha", "gqa", "gqa-window", "gqa-window-softcap"],
)
def test_reference_matches_dense_causal_attention(heads, kv_heads, sliding_window, softcap):
    torch.manual_seed(0)
    head_dim, block_size = 32, 8
    q_kv_lens = [(1, 13), (20, 20), (6, 29), (1, 1), (1, 40)]  # decodes, a whole prompt, a chunk after a prefix
    num_pages = [-(-kv_len // block_size) for _, kv_len in q_kv_lens]
    # Sequence i owns the next num_pages[i] blocks, so its keys are one contiguous run.
    k_cache = torch.randn(sum(num_pages), block_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.zeros(len(q_kv_lens), max(num_pages), dtype=torch.int32)
    full_queries, first_block = [], 0
    for i, ((_, kv_len), pages) in enumerate(zip(q_kv_lens, num_pages)):
        block_table[i, :pages] = torch.arange(first_block, first_block + pages)
        first_block += pages
        full_queries.append(torch.randn(kv_len, heads, head_dim))
    q = torch.cat([queries[kv_len - q_len :] for queries, (q_len, kv_len) in zip(full_queries, q_kv_lens)])
    cu_seqlens_q = torch.tensor([0] + [q_len for q_len, _ in q_kv_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor([kv_len for _, kv_len in q_kv_lens], dtype=torch.int32)
    scale = 0.3

    actual = reference.unified_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale,
        sliding_window=sliding_window, softcap=softcap,
    )

    dense_k = k_cache.flatten(0, 1)  # [total_slots, kv_heads, head_dim], sequences back to back
    dense_v = v_cache.flatten(0, 1)
    first_slot = 0
    for i, ((q_len, kv_len), pages) in enumerate(zip(q_kv_lens, num_pages)):
        keys = dense_k[first_slot : first_slot + kv_len].transpose(0, 1)
        values = dense_v[first_slot : first_slot + kv_len].transpose(0, 1)
        first_slot += pages * block_size
        expected = _dense_attention(full_queries[i].transpose(0, 1), keys, values, scale, sliding_window, softcap)
        expected = expected.transpose(0, 1)[kv_len - q_len :]  # the queries this step computes
        torch.testing.assert_close(actual[cu_seqlens_q[i] : cu_seqlens_q[i + 1]], expected, atol=1e-5, rtol=1e-5)
