"""A layer's mixture-of-experts block: the router, the fused experts and Qwen2-MoE's gated shared expert.

The router runs once per layer on the whole batch (``kernels.select_experts``:
HF's fp32 softmax, top-k and optional renormalisation); the experts run as one
``kernels.fused_moe`` over the fused per-layer weights. On a tensor-parallel
rank the experts and the shared expert hold a slice of their intermediate
features, so the block's output is a partial sum (the caller all-reduces it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from pd.model.config import MoeConfig
from pd.model.linear import Linear


@dataclass
class MoeWeights:
    gate: Linear  # hidden -> num_experts: the router (replicated on every rank)
    w13: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor  # [E, H, I]
    shared_gate_up: Linear | None = None  # hidden -> 2 * shared intermediate (Qwen2-MoE)
    shared_down: Linear | None = None  # shared intermediate -> hidden
    shared_expert_gate: Linear | None = None  # hidden -> 1

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the experts multiply in: the weights' (fp32 where the host has no native half GEMM)."""
        return self.w13.dtype


def moe_block(weights: MoeWeights, config: MoeConfig, hidden: torch.Tensor, num_tokens: int,
              backend: str) -> torch.Tensor:
    """The block's output for ``hidden``'s first ``num_tokens`` rows; the padding rows after them are zeros.

    Padding rows (``CausalLM._rows``) are never routed, so they take no expert's time.
    """
    rows = hidden.shape[0]
    tokens = hidden[:num_tokens]
    router_logits = weights.gate(tokens)
    topk_weights, topk_ids = kernels.select_experts(router_logits, config.top_k, config.renormalize)
    # HF casts the routing weights to the activations' dtype before weighting the experts' outputs.
    topk_weights = topk_weights.to(hidden.dtype)
    compute = weights.compute_dtype
    out = kernels.fused_moe(tokens.to(compute), weights.w13, weights.w2, topk_ids, topk_weights,
                            backend=backend).to(hidden.dtype)
    if weights.shared_gate_up is not None:
        shared = weights.shared_down(kernels.silu_and_mul(weights.shared_gate_up(tokens), backend=backend))
        out += torch.sigmoid(weights.shared_expert_gate(tokens)) * shared
    if rows == num_tokens:
        return out
    padded = out.new_zeros(rows, out.shape[1])
    padded[:num_tokens] = out
    return padded
