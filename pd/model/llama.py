"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and Qwen3, and their MoE kin Mixtral, Qwen2-MoE and Qwen3-MoE.

Dense layers are ``Linear`` objects (QKV and gate/up fused at load time), in
the fastest form for the device (see ``pd.model.linear``). Each phase is a
small function. Attention, the KV store, RMSNorm and rotary go through
``pd_kernels`` so that the backend chosen per step is the one the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

import pd_kernels
from pd.model.attention import AttentionMetadata
from pd.model.config import ModelConfig
from pd.model.linear import Linear, padded_rows
from pd.model.moe import MoeWeights, moe_block


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: Linear  # hidden -> q_size + 2 * kv_size
    q_norm: torch.Tensor | None  # [head_dim], Qwen3 only
    k_norm: torch.Tensor | None
    o_proj: Linear  # q_size -> hidden (row-parallel: without its bias, added after the all-reduce)
    o_bias: torch.Tensor | None  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: Linear | None  # hidden -> 2 * intermediate; None in an MoE layer
    down_proj: Linear | None  # intermediate -> hidden (row-parallel, as o_proj)
    down_bias: torch.Tensor | None  # [hidden]
    moe: MoeWeights | None = None  # the MoE block, in place of the dense MLP


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab rows, hidden]: the whole vocabulary, or a rank's slice of it
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> vocab rows
    num_bytes: int = 0  # the weights' bytes as loaded
    vocab_start: int = 0  # the first token id of the slice


class Collectives(Protocol):
    """What a tensor-parallel rank's forward pass needs of its group (``pd.engine.tp.group``)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor: ...


class ExpertBlocks(Protocol):
    """An expert-parallel rank's MoE blocks (``pd.engine.ep.dispatch.ExpertParallel``): each returns the
    block's whole output, already reduced over the ranks."""

    def moe_block(self, layer: int, weights: MoeWeights, config, hidden: torch.Tensor, num_tokens: int,
                  backend: str) -> torch.Tensor: ...


class CausalLM:
    """A decoder-only transformer over a paged, block-major KV pool.

    With ``collectives``, one tensor-parallel rank of it: ``config`` is the
    rank's (``TPShard.local_config``), ``weights`` its shard, and the
    row-parallel outputs and the embedding are all-reduced; the logits are
    gathered (whole on rank 0, see ``Collectives.gather_logits``). With
    ``experts``, an expert-parallel rank: its MoE blocks run there.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, cos_sin_cache: torch.Tensor,
                 collectives: Collectives | None = None, experts: ExpertBlocks | None = None, *,
                 kv_scales: tuple[tuple[float, float], ...] | None = None):
        self.config = config
        # Each layer's (k_scale, v_scale) for an FP8 pool (pd.model.kv_scales); 1.0 reads any other as it is.
        self.kv_scales = kv_scales or ((1.0, 1.0),) * config.num_layers
        self.weights = weights
        self.collectives = collectives
        self.experts = experts
        self.cos_sin_cache = cos_sin_cache  # [max_positions, head_dim] fp32
        self.softmax_scale = config.head_dim**-0.5

    def forward(
        self,
        token_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [num_blocks, block_size, kv_heads, head_dim]
        logits_indices: torch.Tensor,  # int64 [num_samples], rows of the batch that sample
    ) -> torch.Tensor:
        """Run the batch, write its K/V into the pool, return fp32 logits ``[num_samples, vocab]``."""
        num_tokens = token_ids.shape[0]
        rows = self._rows(num_tokens)
        # Every row-wise op runs on the rows oneDNN's GEMMs take, so no dense layer copies its input into
        # a padded one (four copies a layer). The padding rows (token 0's embedding) are computed and
        # never read: rotary, the KV store, attention and the logits take the batch's rows only.
        token_ids = F.pad(token_ids, (0, rows - num_tokens)) if rows != num_tokens else token_ids
        # Every layer's attention writes the batch's rows of this one buffer; padding rows stay zero.
        attn_out = (torch.zeros if rows != num_tokens else torch.empty)(
            rows, self.config.num_heads, self.config.head_dim, dtype=self.weights.embed_tokens.dtype,
            device=token_ids.device)
        hidden = self._embed(token_ids)
        residual = None
        for layer, weights in enumerate(self.weights.layers):
            if residual is None:
                residual = hidden
                hidden = pd_kernels.rms_norm(hidden, weights.input_norm, self.config.rms_norm_eps, backend=attn.backend)
            else:
                hidden, residual = pd_kernels.rms_norm(
                    hidden, weights.input_norm, self.config.rms_norm_eps, residual, backend=attn.backend
                )
            hidden = self._attention(layer, weights, hidden, positions, attn, kv_caches[layer], num_tokens, attn_out)
            hidden, residual = pd_kernels.rms_norm(
                hidden, weights.post_attention_norm, self.config.rms_norm_eps, residual, backend=attn.backend
            )
            hidden = self._mlp(layer, weights, hidden, num_tokens, attn.backend)
        hidden = (hidden + residual)[logits_indices]
        hidden = pd_kernels.rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps, backend=attn.backend)
        logits = self.weights.lm_head(hidden).float()
        if self.collectives is None:
            return logits
        return self.collectives.gather_logits(logits, self.config.vocab_size)

    def _rows(self, num_tokens: int) -> int:
        """The rows a batch of ``num_tokens`` runs as: ``padded_rows`` where the dense layers are oneDNN's."""
        return padded_rows(num_tokens) if self.weights.layers and self.weights.layers[0].qkv_proj.packed else num_tokens

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding; a rank looks up the tokens in its vocabulary slice, zeros elsewhere, and sums."""
        if self.collectives is None:
            return F.embedding(token_ids, self.weights.embed_tokens)
        local = token_ids - self.weights.vocab_start
        outside = (local < 0) | (local >= self.weights.embed_tokens.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weights.embed_tokens)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.collectives.all_reduce(hidden)

    def _mlp(self, layer: int, weights: LayerWeights, hidden: torch.Tensor, num_tokens: int,
             backend: str) -> torch.Tensor:
        """The layer's dense MLP or MoE block, its ranks' partial sums reduced."""
        if weights.moe is not None and self.experts is not None:
            return self.experts.moe_block(layer, weights.moe, self.config.moe, hidden, num_tokens, backend)
        if weights.moe is not None:
            return self._reduced(moe_block(weights.moe, self.config.moe, hidden, num_tokens, backend), None)
        return self._reduced(weights.down_proj(pd_kernels.silu_and_mul(weights.gate_up_proj(hidden), backend=backend)),
                             weights.down_bias)

    def _reduced(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel layer's output: the ranks' partial sums added up, then its bias."""
        out = partial if self.collectives is None else self.collectives.all_reduce(partial)
        return out if bias is None else out + bias

    def _attention(
        self,
        layer: int,
        weights: LayerWeights,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        num_tokens: int,  # the batch's rows; hidden may have padding rows after them
        out: torch.Tensor,  # [hidden's rows, heads, head_dim]: attention writes its first num_tokens rows
    ) -> torch.Tensor:
        cfg = self.config
        rows = hidden.shape[0]
        qkv = weights.qkv_proj(hidden)[:num_tokens]
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
        return self._reduced(weights.o_proj(out.view(rows, cfg.q_size)), weights.o_bias)

