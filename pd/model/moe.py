"""A layer's mixture-of-experts block: the router, the fused experts and Qwen2-MoE's gated shared expert.

The router runs once per layer on the whole batch (``pd_kernels.select_experts``:
HF's fp32 softmax, top-k and optional renormalisation); the experts run as one
``pd_kernels.fused_moe`` over the fused per-layer weights. On a tensor-parallel
rank the experts and the shared expert hold a slice of their intermediate
features, so the block's output is a partial sum (the caller all-reduces it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pd_kernels
from pd.model.config import MoeConfig
from pd.model.linear import Linear


@dataclass
class MoeWeights:
    gate: Linear  # hidden -> num_experts: the router (replicated on every rank)
    w13: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor  # [E, H, I]
    shared_gate_up: Linear | None = None  # hidden -> 2 * shared intermediate (Qwen2-MoE)
    shared_down: Linear | None = None  # shared intermediate -> hidden
    shared_expert_gate: Linear | None = None  # hidden -> 1; None: the shared experts are added ungated (DeepSeek)
    score_bias: torch.Tensor | None = None  # [E] fp32: DeepSeek-V3's e_score_correction_bias, for the choice only

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the experts multiply in: the weights' (fp32 where the host has no native half GEMM)."""
        return self.w13.dtype


def route(weights: MoeWeights, config: MoeConfig, hidden: torch.Tensor,
          num_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts and their weights of ``hidden``'s first ``num_tokens`` rows (all of them by default)
    (``pd_kernels.select_experts``), as the family's router chooses. The router, a dense layer, runs on all
    the rows (the padded counts its GEMM takes); ``select_experts`` scores its logits in fp32."""
    logits = weights.gate(hidden)[:num_tokens]
    return pd_kernels.select_experts(
        logits, config.top_k, config.renormalize, scoring=config.scoring, score_bias=weights.score_bias,
        topk_method=config.topk_method, num_groups=config.num_groups, topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor)


def moe_block(weights: MoeWeights, config: MoeConfig, hidden: torch.Tensor, num_tokens: int,
              backend: str) -> torch.Tensor:
    """The block's output for ``hidden``'s first ``num_tokens`` rows; the padding rows after them
    (``CausalLM._rows``) are never routed, so they take no expert's time.

    The router and the shared expert are dense layers, so they run on all of ``hidden``'s rows (the
    bucketed counts oneDNN's GEMMs take); their padding rows are computed and never read.
    """
    rows = hidden.shape[0]
    topk_weights, topk_ids = route(weights, config, hidden, num_tokens)
    # HF casts the routing weights to the activations' dtype before weighting the experts' outputs.
    topk_weights = topk_weights.to(hidden.dtype)
    compute = weights.compute_dtype
    experts = pd_kernels.fused_moe(hidden[:num_tokens].to(compute), weights.w13, weights.w2, topk_ids, topk_weights,
                                backend=backend).to(hidden.dtype)
    if weights.shared_gate_up is not None:
        shared = weights.shared_down(pd_kernels.silu_and_mul(weights.shared_gate_up(hidden), backend=backend))
        out = shared if weights.shared_expert_gate is None else shared.mul_(
            torch.sigmoid(weights.shared_expert_gate(hidden)))
        out[:num_tokens] += experts
        return out
    if rows == num_tokens:
        return experts
    out = experts.new_zeros(rows, experts.shape[1])
    out[:num_tokens] = experts
    return out
