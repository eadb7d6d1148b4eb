"""Analytic step costs for GPUs we have no profile of: a roofline from datasheet peaks and stated efficiencies.

For a decoder of ``P`` non-embedding parameters (plus the LM head) in bf16,
one engine step costs

    base_s       = weight bytes / (HBM bandwidth * mem_efficiency)     every step reads every weight once
                   + step_overhead_s                                   launch, scheduling, sampling setup
    per_token_s  = 2 * P / (bf16 FLOP/s * mfu)                         the dense layers, per token
    per_pair_s   = 4 * layers * heads * head_dim / (bf16 FLOP/s * attn_efficiency)
                                                                       QK^T and PV, per query-key pair
    per_sample_s = 2 * hidden * vocab / (bf16 FLOP/s * mfu)            the LM head, per sampled row

and the step's time is their sum (``sim.cost``). A sum, not a max: a step
that is both memory- and compute-heavy is charged for both, which
overstates mid-sized batches by at most 2x. Every such profile says
``analytic`` in its ``source``, with the efficiencies it assumed.

A mixture of experts differs in two places. ``P`` in ``per_token_s`` is
its *active* parameters (``num_active_params``: attention, dense layers'
MLPs, and per MoE layer the router, ``top_k`` experts and any shared
expert); ``base_s`` reads every weight but the routed experts, and
``CostModel.experts`` reads, per MoE layer, the experts the step's tokens
touch (``ExpertReads``: k of E at one token, all E for a long prefill), at
the same bandwidth. Memory holds every expert (``weight_bytes``), so the
KV pool is what the whole checkpoint leaves.

Datasheet figures (dense bf16 tensor-core FLOP/s without sparsity, HBM
bandwidth, NVLink per GPU both directions, the NIC each GPU usually gets):
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pd.model.config import ModelConfig
from sim.cost import CostModel, ExpertReads
from sim.transport import TransferModel


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float  # per GPU, both directions
    nic_bytes_per_s: float
    host_link_bytes_per_s: float  # host memory <-> GPU, one direction, pinned: PCIe x16 at ~80% of its rate


HARDWARE = {
    "a100": Hardware("A100 SXM 80GB", 312e12, 2.039e12, 80e9, 600e9, 25e9, 25e9),  # PCIe Gen4
    "h100": Hardware("H100 SXM", 989e12, 3.35e12, 80e9, 900e9, 50e9, 50e9),  # PCIe Gen5
    "h200": Hardware("H200 SXM", 989e12, 4.8e12, 141e9, 900e9, 50e9, 50e9),
    "b200": Hardware("B200", 2250e12, 8.0e12, 180e9, 1800e9, 50e9, 50e9),
}


@dataclass(frozen=True)
class Efficiency:
    mfu: float = 0.5  # of peak FLOP/s the dense layers reach
    attn_efficiency: float = 0.3  # of peak FLOP/s attention reaches (paged, mixed lengths)
    mem_efficiency: float = 0.8  # of HBM bandwidth a weight read reaches
    step_overhead_s: float = 1e-3
    per_seq_s: float = 10e-6  # block tables, sampling bookkeeping
    kv_fraction: float = 0.9  # of the memory left after weights, given to the KV pool


# Model shapes (config.json fields) of common checkpoints, for planning without the checkpoint.
MODELS = {
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": 128001},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "eos_token_id": 151643},
    # 128 experts, 8 a token: 30.5B parameters, 3.3B active (both with the embeddings).
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                      "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
                      "eos_token_id": 151645},
}


def model_dir(model: str) -> str:
    """A directory ``LLMEngine`` can read for ``model``: a preset's config.json written once, or ``model`` itself."""
    if model not in MODELS:
        return model
    path = Path(tempfile.gettempdir()) / "pd-sim-models" / model
    path.mkdir(parents=True, exist_ok=True)
    config = path / "config.json"
    if not config.exists():
        config.write_text(json.dumps(MODELS[model]))
    return str(path)


def _attention_params(model: ModelConfig) -> int:
    hidden = model.hidden_size
    return hidden * (model.q_size + 2 * model.num_kv_heads * model.head_dim) + model.q_size * hidden


def _mlp_params(model: ModelConfig, layer: int, experts_per_token: bool) -> int:
    """Layer ``layer``'s MLP: a dense one, or the MoE block with every expert or only the ``top_k`` a token uses.

    The MoE block is its router (hidden x experts), its experts (gate, up
    and down each) and, in Qwen2-MoE, a shared expert with its one-row gate.
    """
    hidden = model.hidden_size
    moe = model.moe
    if moe is None or not moe.layers[layer]:
        return 3 * hidden * model.intermediate_size
    experts = moe.top_k if experts_per_token else moe.num_experts
    shared = moe.shared_expert_intermediate_size
    return (hidden * moe.num_experts + experts * 3 * hidden * moe.intermediate_size
            + (3 * hidden * shared + hidden if shared else 0))


def num_params(model: ModelConfig) -> int:
    """Non-embedding parameters: attention and MLP of every layer, every expert of an MoE's."""
    return sum(_attention_params(model) + _mlp_params(model, layer, False) for layer in range(model.num_layers))


def num_active_params(model: ModelConfig) -> int:
    """Non-embedding parameters one token computes with: an MoE layer's router, ``top_k`` and shared experts."""
    return sum(_attention_params(model) + _mlp_params(model, layer, True) for layer in range(model.num_layers))


def weight_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """Every weight a replica holds: ``num_params`` and the embeddings and LM head (counted untied)."""
    return dtype_bytes * (num_params(model) + 2 * model.hidden_size * model.vocab_size)


def expert_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """The routed experts' weights of every MoE layer (a step reads only those its tokens touch); 0 if dense."""
    moe = model.moe
    if moe is None:
        return 0
    return dtype_bytes * moe.num_moe_layers * moe.num_experts * 3 * model.hidden_size * moe.intermediate_size


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2) -> int:
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * dtype_bytes


def analytic_cost(model: ModelConfig, hardware: Hardware, efficiency: Efficiency = Efficiency()) -> CostModel:
    weight_read_bytes_per_s = hardware.hbm_bytes_per_s * efficiency.mem_efficiency
    dense_flops = hardware.bf16_flops * efficiency.mfu
    moe = model.moe
    experts = None
    if moe is not None and moe.num_moe_layers:
        one_expert = 2 * 3 * model.hidden_size * moe.intermediate_size
        experts = ExpertReads(num_layers=moe.num_moe_layers, num_experts=moe.num_experts, top_k=moe.top_k,
                              per_expert_s=one_expert / weight_read_bytes_per_s)
    return CostModel(
        base_s=(weight_bytes(model) - expert_bytes(model)) / weight_read_bytes_per_s + efficiency.step_overhead_s,
        per_token_s=2 * num_active_params(model) / dense_flops,
        per_pair_s=4 * model.num_layers * model.num_heads * model.head_dim
        / (hardware.bf16_flops * efficiency.attn_efficiency),
        per_seq_s=efficiency.per_seq_s,
        per_sample_s=2 * model.hidden_size * model.vocab_size / dense_flops,
        per_host_byte_s=1 / hardware.host_link_bytes_per_s,
        source=f"analytic: {hardware.name} roofline, mfu {efficiency.mfu}, attention {efficiency.attn_efficiency}, "
               f"HBM {efficiency.mem_efficiency}",
        experts=experts,
    )


def kv_cache_bytes(model: ModelConfig, hardware: Hardware, efficiency: Efficiency = Efficiency()) -> int:
    """The KV pool one GPU holds after its weights (every expert's, for an MoE)."""
    return int((hardware.hbm_bytes - weight_bytes(model)) * efficiency.kv_fraction)


def link(hardware: Hardware, kind: str) -> TransferModel:
    """KV transfer between GPUs of one node (``nvlink``) or across nodes (``rdma``)."""
    if kind == "nvlink":
        return TransferModel(20e-6, 1e-6, hardware.nvlink_bytes_per_s / 2, f"analytic: {hardware.name} NVLink")
    return TransferModel(50e-6, 2e-6, hardware.nic_bytes_per_s, f"analytic: {hardware.name} RDMA NIC")
