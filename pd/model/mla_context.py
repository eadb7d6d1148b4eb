"""Long contexts for MLA's decompressed prefill: the context expanded chunk by chunk, merged by log-sum-exp.

The decompressed path (``pd.model.mla``) expands every context token's latent
to per-head K and V, ``heads × (qk_head_dim + v_head_dim)`` values a token: for
DeepSeek-V3's 16 heads a rank, 5 KiB of bf16 per token, 640 MiB at 128K tokens.
Past ``CONTEXT_CHUNK_TOKENS`` a sequence's context is expanded ``chunk`` tokens
at a time instead, as vLLM's chunked-context MLA prefill does, and each chunk's
attention is folded into a running softmax:

    m' = max(m, max_k s)      l' = l·e^(m−m') + Σ_k e^(s−m')      o' = o·e^(m−m') + Σ_k e^(s−m') v_k

so the scratch is bounded by the chunk, whatever the context. The products
are torch's matrix products (oneDNN on CPU, cuBLAS on GPU); the short
contexts that most prefills have take the paged kernels.
"""

from __future__ import annotations

import torch

# Contexts of more tokens than this are expanded in chunks of this many.
CONTEXT_CHUNK_TOKENS = 8192


def chunked_context_attention(q: torch.Tensor, positions: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
                              w_uv: torch.Tensor, softmax_scale: float, chunk: int) -> torch.Tensor:
    """Causal attention of one sequence's queries over its context, expanded ``chunk`` tokens at a time.

    q: [n, heads, nope + rope] (``q_nope`` then the rotated ``q_pe``); positions: int64 [n], each query's
    position in the sequence; latent: [context, kv_lora_rank + rope], the context's rows in position
    order (fp32 or the model's dtype); w_uk: [heads, nope, rank]; w_uv: [heads, v, rank].
    Returns [n, heads, v].
    """
    heads, nope, rank = w_uk.shape
    n = q.shape[0]
    q = q.transpose(0, 1).float()  # [heads, n, nope + rope]
    best = q.new_full((heads, n, 1), float("-inf"))
    total = q.new_zeros(heads, n, 1)
    acc = q.new_zeros(heads, n, w_uv.shape[1])
    for start in range(0, latent.shape[0], chunk):
        rows = latent[start:start + chunk]
        c_kv, k_pe = rows[:, :rank], rows[:, rank:]
        k_nope = torch.einsum("kr,hdr->hkd", c_kv, w_uk).float()  # [heads, keys, nope]
        v = torch.einsum("kr,hvr->hkv", c_kv, w_uv).float()  # [heads, keys, v]
        scores = (torch.matmul(q[:, :, :nope], k_nope.transpose(1, 2))
                  + torch.matmul(q[:, :, nope:], k_pe.float().T)) * softmax_scale  # [heads, n, keys]
        key_positions = torch.arange(start, start + rows.shape[0], device=q.device)
        scores.masked_fill_(key_positions[None, None, :] > positions[None, :, None], float("-inf"))
        # Every query sees key 0, in the first chunk: from then on its best score is finite.
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        rescale = torch.exp(best - new_best)
        weights = torch.exp(scores - new_best)
        total = total * rescale + weights.sum(-1, keepdim=True)
        acc = acc * rescale + torch.matmul(weights, v)
        best = new_best
    return (acc / total).transpose(0, 1)  # [n, heads, v]
