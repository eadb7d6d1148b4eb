"""Attention and fused kernels over a paged, block-major KV pool.

This package imports nothing from ``pd``. Every entry point checks its
arguments on the host, then dispatches to a backend:

- ``"torch"``: the reference in ``pd_kernels.reference``;
- ``"cpu"``: decode attention straight from the pool and the small-op chains
  in C++ (``pd_kernels.cpu``; compiled on first use), the rest the reference;
- ``"triton"``: Triton kernels, on CUDA or on CPU under ``TRITON_INTERPRET=1``;
- ``"auto"``: Triton for CUDA tensors, ``cpu`` otherwise (``torch`` if the C++
  kernel cannot be built here, with a warning saying why).

Backends import lazily, so ``import pd_kernels`` works without Triton. Each entry
point's signature is spelled out here, one argument a line; every backend's
twin takes the same arguments in the same order
(``tests/pd_kernels/test_signatures.py`` checks it).
"""

from __future__ import annotations

import importlib
import logging

import torch

from pd_kernels import reference
from pd_kernels.checks import (
    NO_LORA,
    PAD_SLOT_ID,
    check_attention_args,
    check_fused_moe_args,
    check_latent_attention_args,
    check_lora_args,
    check_select_experts_args,
    check_store_kv_args,
    check_store_latent_args,
)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "triton")

__all__ = ["BACKENDS", "PAD_SLOT_ID", "resolve_backend", "unified_attention", "store_kv", "latent_attention",
           "store_latent", "rms_norm", "rotary_embedding", "silu_and_mul", "select_experts", "fused_moe",
           "NO_LORA", "lora_delta"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend (``"torch"`` or ``"triton"``) for ``backend`` on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if torch.device(device).type == "cuda":
            return "triton"
        try:
            importlib.import_module("pd_kernels.cpu").build()
        except Exception as exc:  # noqa: BLE001 - no compiler here: the reference still serves, said out loud
            logger.warning("the cpu attention kernel cannot be built (%s); using the torch reference", exc)
            return "torch"
        return "cpu"
    return backend


# (backend, device type) -> its module: resolved once, since every layer of every step asks.
_impls: dict[tuple[str, str], object] = {}


def _impl(backend: str, device: torch.device):
    key = (backend, device.type)
    module = _impls.get(key)
    if module is None:
        module = _impls[key] = _resolve_impl(backend, device)
    return module


def _resolve_impl(backend: str, device: torch.device):
    resolved = resolve_backend(backend, device)
    if resolved == "torch":
        return reference
    if resolved == "cpu":
        return importlib.import_module("pd_kernels.cpu")
    try:
        return importlib.import_module("pd_kernels.triton")
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(f"the triton backend needs the 'triton' package ({exc}); pip install triton") from exc


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Paged attention for a mixed batch of prefill chunks and decode tokens.

    q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim] views of the block-major pool (any
    strides, head_dim contiguous); cu_seqlens_q: int32 [num_seqs + 1];
    seq_lens: int32 [num_seqs], each sequence's KV length including this
    step's tokens; block_table: int32 [num_seqs, max_blocks_per_seq].

    Sequence i's queries are its last ``q_len_i`` tokens; query j sits at
    position ``seq_lens[i] - q_len_i + j`` and sees keys up to that position
    (and, with ``sliding_window=W``, only keys ``k > position - W``). With
    ``softcap``, scores become ``softcap * tanh(score / softcap)``.
    The pool is of q's dtype, or FP8 (``pd_kernels.fp8``): its pages read as
    ``float(stored) * k_scale`` (``v_scale`` for values).
    Returns [num_tokens, num_heads, head_dim].
    """
    check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, sliding_window, softcap, out,
                         k_scale, v_scale)
    return _impl(backend, q.device).unified_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale,
        sliding_window=sliding_window, softcap=softcap, out=out, k_scale=k_scale, v_scale=v_scale,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: str = "auto",
) -> None:
    """Write this step's K/V ``[num_tokens, kv_heads, head_dim]`` into their slots.

    Slots equal to ``PAD_SLOT_ID`` are skipped. Into an FP8 pool, each value
    is stored as ``Q(x / scale)``, saturated (``pd_kernels.fp8.quantize``).
    """
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _impl(backend, key.device).store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def latent_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    *,
    v_dim: int,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Multi-head latent attention with the weights absorbed: every query head attends over one shared
    latent row per token, read straight from its pages.

    q: [num_tokens, num_heads, latent_dim], each head's ``q_nope · W_UK`` then its rotated ``q_pe``;
    latent_cache: [num_blocks, block_size, 1, latent_dim], a view of the latent pool (``latent_dim`` =
    kv_lora_rank + qk_rope_head_dim, contiguous); the rest as ``unified_attention`` (causal, no window).
    Each row is the key whole and the value in its first ``v_dim`` (kv_lora_rank) values. An FP8 pool
    reads as ``float(stored) * scale``. Returns [num_tokens, num_heads, v_dim]: each head's output in the
    latent space, for ``· W_UV``.
    """
    check_latent_attention_args(q, latent_cache, cu_seqlens_q, seq_lens, block_table, v_dim, out, scale)
    impl = _impl(backend, q.device)
    if not hasattr(impl, "latent_attention"):
        raise NotImplementedError(f"the {resolve_backend(backend, q.device)} backend has no latent attention kernel "
                                  "yet; run multi-head latent attention with attention_backend 'torch' or 'cpu'")
    return impl.latent_attention(q, latent_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, v_dim=v_dim,
                                 out=out, scale=scale)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, scale: float = 1.0) -> None:
    """Write this step's latent rows ``[num_tokens, latent_dim]`` into their slots of ``cache`` ``[num_blocks,
    block_size, 1, latent_dim]`` (``PAD_SLOT_ID`` skipped; FP8 as ``store_kv``). One contiguous row per
    token, so the torch ops are the kernel on every backend."""
    check_store_latent_args(latent, cache, slot_mapping, scale)
    reference.store_latent(latent, cache, slot_mapping, scale=scale)


def rms_norm(x, weight, eps: float, residual=None, *, backend: str = "auto"):
    """RMSNorm; with ``residual`` returns ``(norm(x + residual), x + residual)``."""
    return _impl(backend, x.device).rms_norm(x, weight, eps, residual)


def rotary_embedding(q, k, positions, cos_sin_cache, *, backend: str = "auto"):
    """Rotate-half rotary embedding of q and k at ``positions``; returns ``(q, k)``."""
    return _impl(backend, q.device).rotary_embedding(q, k, positions, cos_sin_cache)


def silu_and_mul(gate_up, *, backend: str = "auto"):
    """``silu(gate) * up`` for ``gate_up = [gate | up]``, ``[num_tokens, 2 * n]`` -> ``[num_tokens, n]``."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [num_tokens, 2 * n], got {tuple(gate_up.shape)}")
    return _impl(backend, gate_up.device).silu_and_mul(gate_up)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, *, scoring: str = "softmax",
                   score_bias: torch.Tensor | None = None, topk_method: str = "greedy", num_groups: int = 1,
                   topk_group: int = 1, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and weights from ``router_logits [T, E]``, once per layer for the batch:
    fp32 softmax, top-k, renormalised if asked. Returns ``(topk_weights fp32, topk_ids int64)``, ``[T, k]``.

    DeepSeek's routing (``pd.model.config.MoeConfig``): ``scoring`` "sigmoid", ``score_bias`` added for
    the choice only, ``topk_method`` "noaux_tc" or "group_limited_greedy" over ``num_groups`` groups of
    which the best ``topk_group`` are kept, and the weights times ``routed_scaling_factor``."""
    check_select_experts_args(router_logits, top_k, scoring=scoring, score_bias=score_bias, topk_method=topk_method,
                              num_groups=num_groups, topk_group=topk_group,
                              routed_scaling_factor=routed_scaling_factor)
    return reference.select_experts(router_logits, top_k, renormalize, scoring=scoring, score_bias=score_bias,
                                    topk_method=topk_method, num_groups=num_groups, topk_group=topk_group,
                                    routed_scaling_factor=routed_scaling_factor)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs of each token, weighted by ``topk_weights`` and summed: ``[T, H]``.

    hidden: [T, H]; w13: [E, 2I, H], each expert's gate rows then up rows;
    w2: [E, H, I]; topk_ids (int32/int64) and topk_weights: [T, k], as
    ``select_experts`` gives them.
    """
    check_fused_moe_args(hidden, w13, w2, topk_ids, topk_weights)
    return _impl(backend, hidden.device).fused_moe(hidden, w13, w2, topk_ids, topk_weights)


def lora_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    slice_starts: tuple[int, ...],
    *,
    backend: str = "auto",
) -> None:
    """Add each row's LoRA adapter delta into the base layer's output ``out``, in place (Punica's shrink, then
    expand: many adapters in one batch).

    out: [num_rows, out_features], the base layer's output; x: [num_rows, in_features], its input;
    lora_a: [num_slots, num_slices * rank, in_features], each slot's A matrices, slices stacked;
    lora_b: [num_slots, out_features, rank], each slot's B with the adapter's scaling folded in; all of one
    dtype (fp32, bf16, fp16). row_slots: int32 [num_rows], each row's slot, ``NO_LORA`` for a row without an
    adapter (left untouched, at almost no cost); a slot's rows need not be adjacent. slice_starts: each
    slice's first output column, ascending from 0 (``(0,)`` unfused; ``(0, q, q + kv)`` for a fused q|k|v).

    For row n of slot s: ``t = lora_a[s] @ x[n]`` in fp32 (never rounded to the dtype), then for a column o
    of slice i, ``out[n, o] += lora_b[s, o] . t[i * rank : (i + 1) * rank]``, accumulated in fp32 and rounded
    once (``pd_kernels.reference_lora``).
    """
    check_lora_args(out, x, lora_a, lora_b, row_slots, slice_starts)
    _impl(backend, out.device).lora_delta(out, x, lora_a, lora_b, row_slots, tuple(slice_starts))
