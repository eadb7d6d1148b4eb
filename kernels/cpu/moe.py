"""Fused MoE on CPU: token slots sorted by expert once, then one matmul pair per active expert.

The reference (HF's eager loop) scans the routing table once per expert to
find its tokens and gathers them apart. Here one stable sort of the ``T * k``
slots by expert lays every expert's rows out contiguously, one gather builds
them, each active expert runs its gate/up and down projections (oneDNN's GEMM)
on its own slice, and one ``index_add_`` weights and sums the slots back into
their tokens. The only Python loop is over the experts that received tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, in token order within each
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k  # each sorted slot's token
    rows = hidden[tokens]
    down = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            chunk = rows[start:start + count]
            torch.matmul(reference.silu_and_mul(F.linear(chunk, w13[expert])), w2[expert].t(),
                         out=down[start:start + count])
            start += count
    down.mul_(topk_weights.reshape(-1)[order].to(hidden.dtype)[:, None])
    out = torch.zeros_like(hidden)
    return out.index_add_(0, tokens, down)
