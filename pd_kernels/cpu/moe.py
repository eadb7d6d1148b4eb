"""Fused MoE on CPU: one C++ call for batches of a few hundred slots per expert, sorted-slot GEMMs above.

Two paths, chosen by the batch's average slots (token-expert pairs) per expert:

- up to ``MAX_SLOTS_PER_EXPERT``, fp32: ``moe.cpp``'s ``fused_moe_rows``, the whole block in one call:
  a counting sort of the slots by expert, then each touched expert's gate/up rows read once per group
  of 4 slots with SiLU-and-mul in registers, then its down rows with the routed weight, summed into each
  token's row by the thread that owns those output columns. No gather, no per-expert ops.
- above it, or in another dtype: one stable sort of the ``T * k`` slots by expert, then for each
  expert that received tokens (the only Python loop) a gather of its rows, its gate/up and down
  projections (oneDNN's GEMMs, rows padded to ``padded_rows``) and an ``index_add_`` of the weighted
  results into their tokens.

Threshold, from ``python -m bench.moe``-shaped runs (H = 1024, I = 512, 2 threads, AMD EPYC, AVX-512):
the C++ call over the GEMM path took 1/3.3 of the time at 4 slots per expert, 1/2.2 at 16, 1/1.5 at 64,
about 1/1.05 at 128 and 1.03x at 256 (on one thread the two met at about 64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pd_kernels.onednn import bf16_supported, linear_pointwise, padded_rows

# Batches with at most this many slots per expert on average (``T * k / E``) run in one C++ call.
MAX_SLOTS_PER_EXPERT = 128


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    if use_rows_kernel(hidden, w13, w2, topk_ids):
        import pd_kernels.cpu  # the package imports this module: its build() is looked up at call time

        return pd_kernels.cpu.build().fused_moe_rows(hidden.contiguous(), w13, w2, topk_ids.long().contiguous(),
                                                  topk_weights.float().contiguous())
    return fused_moe_grouped(hidden, w13, w2, topk_ids, topk_weights)


def use_rows_kernel(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether ``fused_moe`` takes the one-call C++ path: fp32 CPU weights as stored (contiguous: a copy per
    call would cost more than the call) and at most ``MAX_SLOTS_PER_EXPERT`` slots per expert."""
    return (hidden.dtype == torch.float32 and hidden.is_cpu and w13.is_contiguous() and w2.is_contiguous()
            and topk_ids.numel() <= MAX_SLOTS_PER_EXPERT * w13.shape[0])


def fused_moe_grouped(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The GEMM path: slots sorted by expert, one GEMM pair per active expert, one ``index_add_``.

    Where oneDNN runs the dtype, each expert's GEMMs are oneDNN's on the weights as stored (within 6-13%
    of prepacked weights from 128 rows, and 1.3-2x ATen's default GEMM on an AMD EPYC), and each
    expert's rows are padded to ``padded_rows``, so the kernels oneDNN builds per shape stay few.
    """
    top_k, num_experts = topk_ids.shape[1], w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, in token order within each
    tokens = order // top_k  # each sorted slot's token
    weights = topk_weights.reshape(-1)[order].to(hidden.dtype)[:, None]
    onednn = _onednn_runs(hidden, w13)
    gemm = _onednn_gemm if onednn else F.linear
    # One expert at a time, so every temporary is one expert's rows (no large buffer faulted in per call).
    out = torch.zeros_like(hidden)
    start = 0
    for expert, size in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if size:
            index = tokens[start:start + size]
            rows = padded_rows(size) if onednn else size
            if rows != size:  # padding rows are token 0's (finite; never read back)
                index = F.pad(index, (0, rows - size))
            down = gemm(silu_and_mul(gemm(hidden.index_select(0, index), w13[expert])), w2[expert])[:size]
            out.index_add_(0, tokens[start:start + size], down.mul_(weights[start:start + size]))
            start += size
    return out


def _onednn_runs(hidden: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether oneDNN multiplies these natively here: fp32, or bf16 where the CPU has a bf16 path."""
    if linear_pointwise is None or not hidden.is_cpu or hidden.dtype != w13.dtype:
        return False
    return hidden.dtype == torch.float32 or (hidden.dtype == torch.bfloat16 and bf16_supported())


def _onednn_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` by oneDNN, ``weight [out, in]`` as stored (not prepacked)."""
    return linear_pointwise(x, weight, None, "none", [], "")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    import pd_kernels.cpu  # the package imports this module

    return pd_kernels.cpu.silu_and_mul(gate_up)
