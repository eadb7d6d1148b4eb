"""What a model is made of, in the numbers its analytic price needs: parameters by part, their bytes, a
rank's share of them, the KV a token keeps, and attention's FLOPs and bytes per query-key pair.

The parts differ in how they are stored, split and read:

    attention            split by heads over tensor-parallel ranks: GQA's q, k, v and o projections;
                         MLA's q_b (or a full-rank q_proj), kv_b and o
    attention_replicated MLA's down-projections (q_a_proj, kv_a_proj_with_mqa): every head reads them,
                         so each rank holds them whole (as vLLM and SGLang shard MLA)
    dense_mlp            the dense layers' MLPs (every layer of a dense model; DeepSeek's first few)
    routers              each MoE layer's router, hidden x experts
    shared_experts       each MoE layer's shared experts (Qwen2-MoE's with its one-row gate; DeepSeek's ungated)
    routed_experts       each MoE layer's routed experts, every one
    embeddings           the input embeddings and the LM head, counted untied

An 8-bit checkpoint (``ModelConfig.quantization``: DeepSeek-V3's block FP8) stores every linear layer of
its decoder layers in one byte a weight (``QUANTIZED_BYTES``; the per-block scales, 4 bytes a 128 x 128
block, are left out), and its routers, embeddings and LM head in the activations' dtype.

Norms and biases are left out throughout: a few thousand parameters a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.model.config import ModelConfig
from sim.expert_parallel import ExpertParallel

ONE_GPU = ExpertParallel()
QUANTIZED_BYTES = 1  # an 8-bit checkpoint's linear layers: FP8 e4m3 or int8


@dataclass(frozen=True)
class WeightParts:
    """A model's parameters by part (the module's table), summed over its layers."""

    attention: int
    attention_replicated: int
    dense_mlp: int
    routers: int
    shared_experts: int
    routed_experts: int
    routed_active: int  # the routed experts one token computes with: ``top_k`` of every MoE layer
    embeddings: int

    @property
    def linear(self) -> int:
        """The decoder layers' linear weights: what an 8-bit checkpoint stores in one byte."""
        return self.attention + self.attention_replicated + self.dense_mlp + self.shared_experts + self.routed_experts

    @property
    def replicated(self) -> int:
        """What every rank of an expert-parallel replica holds whole: the routers, shared experts and MLA's
        down-projections (``pd.model.loader.load_moe``)."""
        return self.attention_replicated + self.routers + self.shared_experts


def _attention(model: ModelConfig) -> tuple[int, int]:
    """One layer's attention parameters: ``(split by heads, whole on every rank)``."""
    hidden, heads, mla = model.hidden_size, model.num_heads, model.mla
    if mla is None:
        return hidden * (model.q_size + 2 * model.num_kv_heads * model.head_dim) + model.q_size * hidden, 0
    if mla.q_lora_rank is None:  # q_proj: hidden -> heads x (nope + rope)
        q_split, q_whole = hidden * heads * mla.qk_head_dim, 0
    else:  # q_a_proj: hidden -> q_lora_rank; q_b_proj: q_lora_rank -> heads x (nope + rope)
        q_split, q_whole = mla.q_lora_rank * heads * mla.qk_head_dim, hidden * mla.q_lora_rank
    kv_a = hidden * mla.latent_dim  # kv_a_proj_with_mqa: the latent and the rotary key
    kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    o = heads * mla.v_head_dim * hidden
    return q_split + kv_b + o, q_whole + kv_a


def weight_parts(model: ModelConfig) -> WeightParts:
    split, whole = _attention(model)
    hidden, moe = model.hidden_size, model.moe
    num_moe = moe.num_moe_layers if moe is not None else 0
    num_dense = model.num_layers - num_moe
    one_expert = 3 * hidden * moe.intermediate_size if moe is not None else 0  # gate, up and down
    shared = 0
    if moe is not None and moe.shared_expert_intermediate_size:
        shared = 3 * hidden * moe.shared_expert_intermediate_size + (hidden if moe.shared_expert_gated else 0)
    return WeightParts(
        attention=model.num_layers * split, attention_replicated=model.num_layers * whole,
        dense_mlp=num_dense * 3 * hidden * model.intermediate_size,
        routers=num_moe * hidden * moe.num_experts if moe is not None else 0,
        shared_experts=num_moe * shared,
        routed_experts=num_moe * moe.num_experts * one_expert if moe is not None else 0,
        routed_active=num_moe * moe.top_k * one_expert if moe is not None else 0,
        embeddings=2 * hidden * model.vocab_size,
    )


def linear_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of one weight of a decoder layer's linear layer: ``QUANTIZED_BYTES`` in an 8-bit checkpoint."""
    return QUANTIZED_BYTES if model.quantization is not None else dtype_bytes


def num_params(model: ModelConfig) -> int:
    """Non-embedding parameters: attention and MLP of every layer, every expert of an MoE's."""
    parts = weight_parts(model)
    return parts.linear + parts.routers


def num_active_params(model: ModelConfig) -> int:
    """Non-embedding parameters one token computes with: an MoE layer's router, ``top_k`` and shared experts."""
    parts = weight_parts(model)
    return parts.linear - parts.routed_experts + parts.routed_active + parts.routers


def routed_params_per_token(model: ModelConfig) -> int:
    """The routed experts' parameters one token computes with: ``top_k`` experts of every MoE layer."""
    return weight_parts(model).routed_active


def weight_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """Every weight a replica holds: ``num_params`` and the embeddings and LM head (counted untied)."""
    parts = weight_parts(model)
    return linear_bytes(model, dtype_bytes) * parts.linear + dtype_bytes * (parts.routers + parts.embeddings)


def expert_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """The routed experts' weights of every MoE layer (a step reads only those its tokens touch); 0 if dense."""
    return linear_bytes(model, dtype_bytes) * weight_parts(model).routed_experts


def one_expert_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """One routed expert's weights of one layer (gate, up and down)."""
    return linear_bytes(model, dtype_bytes) * 3 * model.hidden_size * model.moe.intermediate_size


def replicated_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """What every expert-parallel rank holds whole (``WeightParts.replicated``)."""
    parts = weight_parts(model)
    return (linear_bytes(model, dtype_bytes) * (parts.attention_replicated + parts.shared_experts)
            + dtype_bytes * parts.routers)


def rank_weight_bytes(model: ModelConfig, parallel: ExpertParallel = ONE_GPU, dtype_bytes: int = 2) -> int:
    """The weights one rank of a replica holds: the dense weights' 1/n (rounded up), what is replicated,
    and (E + R)/n experts of every MoE layer; ``weight_bytes`` with one rank."""
    n = parallel.size
    experts = expert_bytes(model, dtype_bytes)
    whole = replicated_bytes(model, dtype_bytes)
    dense = weight_bytes(model, dtype_bytes) - experts - whole
    if model.moe is None:
        return -(-dense // n) + whole
    num_experts = model.moe.num_experts
    return -(-dense // n) + whole + experts * (num_experts + parallel.num_redundant_experts) // (num_experts * n)


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """What the pool keeps per token over all layers: K and V of every KV head, or MLA's one latent row."""
    return model.kv_values_per_token * dtype_bytes


def prefill_pair_flops(model: ModelConfig) -> int:
    """FLOPs of one query-key pair over all layers and heads, as a prompt's chunk attends: QK^T over the
    query-key head dim and PV over the value head dim. MLA's prompt attends decompressed (kv_b expands
    the context's latents to per-head keys and values: 192 and 128 dims in DeepSeek-V3)."""
    if model.mla is None:
        return 4 * model.num_layers * model.num_heads * model.head_dim
    mla = model.mla
    return 2 * model.num_layers * model.num_heads * (mla.qk_head_dim + mla.v_head_dim)


def decode_pair_flops(model: ModelConfig) -> int:
    """FLOPs of one decode pair under MLA with the weights absorbed: each head's query (``q_nope · W_UK``
    then its rotary part) scores the whole latent row (``latent_dim``) and takes its value in the latent
    space (``kv_lora_rank``), over all layers and heads. ``q_nope · W_UK`` and ``· W_UV`` are per token,
    as kv_b's parameters (``num_active_params``)."""
    mla = model.mla
    return 2 * model.num_layers * model.num_heads * (mla.latent_dim + mla.kv_lora_rank)


def decode_pair_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes one decode pair reads under MLA: the key's latent row of every layer, once for all heads."""
    return model.num_layers * model.mla.latent_dim * dtype_bytes
