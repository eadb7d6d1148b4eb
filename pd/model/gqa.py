"""Grouped-query attention (Llama, Mistral, Qwen and their MoE kin): per-head K and V in the pool.

One of the decoder's two attention kinds (``pd.model.llama.Attention``; the
other is ``pd.model.mla``). QKV is one fused projection; Qwen3 norms each
head's Q and K; rotary, the KV store and paged attention go through
``pd_kernels``. Its pool keeps two planes, K and V, of ``num_kv_heads`` heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pd_kernels
from pd.model.attention import AttentionMetadata
from pd.model.config import ModelConfig
from pd.model.linear import Linear
from pd.model.lora import QKV, O, adapted


@dataclass
class GqaWeights:
    qkv_proj: Linear  # hidden -> q_size + 2 * kv_size
    q_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    k_norm: torch.Tensor | None
    o_proj: Linear  # q_size -> hidden (row-parallel: without its bias, added after the all-reduce)
    o_bias: torch.Tensor | None  # [hidden]

    @property
    def input_proj(self) -> Linear:
        """The layer's first GEMM on the hidden rows (whether it pads rows decides the batch's rows)."""
        return self.qkv_proj


class GqaAttention:
    """A rank's grouped-query attention: ``config`` is the rank's (its heads)."""

    def __init__(self, config: ModelConfig, cos_sin_cache: torch.Tensor, kv_scales: tuple[tuple[float, float], ...]):
        self.config = config
        self.cos_sin_cache = cos_sin_cache  # [max_positions, head_dim] fp32
        self.kv_scales = kv_scales
        self.softmax_scale = config.head_dim**-0.5

    def prepare(self, attn: AttentionMetadata, rows: int, num_tokens: int, dtype: torch.dtype,
                device: torch.device, block_size: int) -> torch.Tensor:
        """The step's output buffer ``[rows, heads, head_dim]``, written by every layer; padding rows zero."""
        return (torch.zeros if rows != num_tokens else torch.empty)(
            rows, self.config.num_heads, self.config.head_dim, dtype=dtype, device=device)

    def forward(
        self,
        layer: int,
        weights: GqaWeights,
        hidden: torch.Tensor,  # [rows, hidden]: the batch's num_tokens rows, then padding
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, ...],  # (k, v) [num_blocks, block_size, kv_heads, head_dim]
        num_tokens: int,
        out: torch.Tensor,  # prepare's buffer
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's row-parallel output (a rank's partial sum) and the bias to add after the reduce."""
        cfg = self.config
        rows = hidden.shape[0]
        qkv = adapted(weights.qkv_proj(hidden), hidden, attn.lora, layer, QKV, attn.backend)[:num_tokens]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if weights.q_norm is not None:
            q = pd_kernels.rms_norm(q, weights.q_norm, cfg.rms_norm_eps, backend=attn.backend)
            k = pd_kernels.rms_norm(k, weights.k_norm, cfg.rms_norm_eps, backend=attn.backend)
        q, k = pd_kernels.rotary_embedding(q, k, positions, self.cos_sin_cache, backend=attn.backend)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = self.kv_scales[layer]
        pd_kernels.store_kv(k, v, k_cache, v_cache, attn.slot_mapping, k_scale=k_scale, v_scale=v_scale,
                            backend=attn.backend)
        pd_kernels.unified_attention(
            q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens, attn.block_table, self.softmax_scale,
            sliding_window=cfg.sliding_windows[layer], backend=attn.backend, out=out[:num_tokens],
            k_scale=k_scale, v_scale=v_scale,
        )
        out = out.view(rows, cfg.q_size)
        return adapted(weights.o_proj(out), out, attn.lora, layer, O, attn.backend), weights.o_bias
