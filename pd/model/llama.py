"""The decoder every architecture runs: Llama 2/3, Mistral, Qwen2 and Qwen3, their MoE kin Mixtral,
Qwen2-MoE and Qwen3-MoE, and DeepSeek-V2/V3.

A layer is RMSNorm, attention, RMSNorm, then a dense MLP or an MoE block.
Attention is one of two kinds behind one interface (``Attention``), chosen by
the architecture's registry entry (``pd.model.architectures``): grouped-query
attention with per-head K/V (``pd.model.gqa``), or multi-head latent attention
whose KV is one latent per token (``pd.model.mla``); each has its own pool
layout (``ModelConfig.kv_planes``, ``kv_head_dim``). Dense layers are
``Linear`` objects (projections fused at load time), in the fastest form for
the device (see ``pd.model.linear``). Attention, the KV store, RMSNorm and
rotary go through ``pd_kernels`` so that the backend chosen per step is the
one the model runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

import pd_kernels
from pd.model.attention import AttentionMetadata
from pd.model.config import ModelConfig
from pd.model.gqa import GqaAttention, GqaWeights
from pd.model.linear import Linear, padded_rows
from pd.model.lora import DOWN, GATE_UP, LoraRows, adapted
from pd.model.mla import MlaAttention, MlaWeights
from pd.model.moe import MoeWeights, moe_block


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    attention: GqaWeights | MlaWeights
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


class Attention(Protocol):
    """One kind of attention (``GqaAttention``, ``MlaAttention``): ``prepare`` builds the step's state once
    (its output buffer, how it splits the batch), then ``forward`` runs a layer and returns its
    row-parallel output and the bias to add after the reduce."""

    def prepare(self, attn: AttentionMetadata, rows: int, num_tokens: int, dtype: torch.dtype,
                device: torch.device, block_size: int): ...

    def forward(self, layer: int, weights, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, ...], num_tokens: int, step) -> tuple[torch.Tensor, torch.Tensor | None]:
        ...


ATTENTION_KINDS = {"gqa": GqaAttention, "mla": MlaAttention}  # pd.model.architectures' ``attention``


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
        self.attention: Attention = ATTENTION_KINDS[config.arch.attention](config, cos_sin_cache, self.kv_scales)

    def forward(
        self,
        token_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],  # per layer, its planes [num_blocks, block_size, kv_heads, dim]
        logits_indices: torch.Tensor,  # int64 [num_samples], rows of the batch that sample
    ) -> torch.Tensor:
        """Run the batch, write its K/V into the pool, return fp32 logits ``[num_samples, vocab]``."""
        num_tokens = token_ids.shape[0]
        rows = self._rows(num_tokens)
        # Every row-wise op runs on the rows oneDNN's GEMMs take, so no dense layer copies its input into
        # a padded one (four copies a layer). The padding rows (token 0's embedding) are computed and
        # never read: rotary, the KV store, attention and the logits take the batch's rows only.
        token_ids = F.pad(token_ids, (0, rows - num_tokens)) if rows != num_tokens else token_ids
        # Every layer's attention writes the batch's rows of one buffer; padding rows stay zero.
        if attn.lora is not None:  # its rows cover the batch's: padding rows take no adapter
            attn = dataclasses.replace(attn, lora=attn.lora.padded(rows))
        step = self.attention.prepare(attn, rows, num_tokens, self.weights.embed_tokens.dtype, token_ids.device,
                                      kv_caches[0][0].shape[1])
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
            hidden = self._reduced(*self.attention.forward(layer, weights.attention, hidden, positions, attn,
                                                           kv_caches[layer], num_tokens, step))
            hidden, residual = pd_kernels.rms_norm(
                hidden, weights.post_attention_norm, self.config.rms_norm_eps, residual, backend=attn.backend
            )
            hidden = self._mlp(layer, weights, hidden, num_tokens, attn.backend, attn.lora)
        hidden = (hidden + residual)[logits_indices]
        hidden = pd_kernels.rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps, backend=attn.backend)
        logits = self.weights.lm_head(hidden).float()
        if self.collectives is None:
            return logits
        return self.collectives.gather_logits(logits, self.config.vocab_size)

    def _rows(self, num_tokens: int) -> int:
        """The rows a batch of ``num_tokens`` runs as: ``padded_rows`` where the dense layers are oneDNN's."""
        layers = self.weights.layers
        return padded_rows(num_tokens) if layers and layers[0].attention.input_proj.packed else num_tokens

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
             backend: str, lora: LoraRows | None = None) -> torch.Tensor:
        """The layer's dense MLP or MoE block, its ranks' partial sums reduced."""
        if weights.moe is not None and self.experts is not None:
            return self.experts.moe_block(layer, weights.moe, self.config.moe, hidden, num_tokens, backend)
        if weights.moe is not None:
            return self._reduced(moe_block(weights.moe, self.config.moe, hidden, num_tokens, backend), None)
        gate_up = adapted(weights.gate_up_proj(hidden), hidden, lora, layer, GATE_UP, backend)
        act = pd_kernels.silu_and_mul(gate_up, backend=backend)
        return self._reduced(adapted(weights.down_proj(act), act, lora, layer, DOWN, backend), weights.down_bias)

    def _reduced(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel layer's output: the ranks' partial sums added up, then its bias."""
        out = partial if self.collectives is None else self.collectives.all_reduce(partial)
        return out if bias is None else out + bias
