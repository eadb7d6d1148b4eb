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

Expert parallelism over ``n`` GPUs (``sim.expert_parallel.ExpertParallel``:
attention split over the same ranks) is priced on the busiest rank:
``base_s`` reads the dense weights' 1/n and the routers and shared experts
whole; ``per_token_s`` computes the dense FLOPs' 1/n (the router and shared
expert run on the rank's 1/n of the tokens) and the routed experts'
1/(n * balancedness); ``per_pair_s`` and ``per_sample_s`` are split n ways;
``ExpertReads`` counts one rank's experts, (E/n)(1 - (1 - k/E)^T), over the
balancedness; and ``Collectives`` adds the all-to-alls and all-reduces over
NVLink (one direction of ``nvlink_bytes_per_s``), each with
``Efficiency.collective_latency_s``. Each rank holds its dense share, the
routers, shared experts and (E + R)/n experts (``rank_weight_bytes``); its
KV pool is what they leave.

Datasheet figures (dense bf16 tensor-core FLOP/s without sparsity, HBM
bandwidth, NVLink per GPU both directions, the NIC each GPU usually gets).
NVLink: A100 NVLink 3, 600 GB/s; H100 and H200 NVLink 4, 900 GB/s (18 links
of 50 GB/s, 450 GB/s each way; NVIDIA's H100 and H200 datasheets); B200
NVLink 5, 1.8 TB/s. An all-to-all in one NVSwitch node reaches nearly one
direction's rate: DeepEP's intranode dispatch and combine at EP 8 run at
153 and 158 GB/s on H800s, whose NVLink gives about 160 GB/s each way
(github.com/deepseek-ai/DeepEP, README).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pd.model.config import ModelConfig
from sim.cost import CostModel, ExpertReads
from sim.expert_parallel import ExpertParallel, collectives
from sim.transport import TransferModel

ONE_GPU = ExpertParallel()


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
    # Each collective between a replica's GPUs (an all-to-all, an all-reduce), beside its bytes. Assumed:
    # one-shot all-reduce kernels on NVSwitch (vLLM's, TensorRT-LLM's) take a few µs, NCCL's small
    # messages tens; a step's collectives are launched back to back, often in one CUDA graph.
    collective_latency_s: float = 10e-6


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


def replicated_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    """What every expert-parallel rank holds whole of each MoE layer: its router (hidden x experts) and any
    shared expert with its gate (``pd.model.loader.load_moe``)."""
    moe = model.moe
    if moe is None:
        return 0
    shared = 3 * model.hidden_size * moe.shared_expert_intermediate_size + model.hidden_size \
        if moe.shared_expert_intermediate_size else 0
    return dtype_bytes * moe.num_moe_layers * (model.hidden_size * moe.num_experts + shared)


def rank_weight_bytes(model: ModelConfig, parallel: ExpertParallel = ONE_GPU, dtype_bytes: int = 2) -> int:
    """The weights one rank of a replica holds: the dense weights' 1/n (rounded up), the routers and shared
    experts, and (E + R)/n experts of every MoE layer; ``weight_bytes`` with one rank."""
    n = parallel.size
    experts = expert_bytes(model, dtype_bytes)
    whole = replicated_bytes(model, dtype_bytes)
    dense = weight_bytes(model, dtype_bytes) - experts - whole
    if model.moe is None:
        return -(-dense // n)
    num_experts = model.moe.num_experts
    return -(-dense // n) + whole + experts * (num_experts + parallel.num_redundant_experts) // (num_experts * n)


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2) -> int:
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * dtype_bytes


def routed_params_per_token(model: ModelConfig) -> int:
    """The routed experts' parameters one token computes with: ``top_k`` experts of every MoE layer."""
    moe = model.moe
    return moe.num_moe_layers * moe.top_k * 3 * model.hidden_size * moe.intermediate_size if moe is not None else 0


def analytic_cost(model: ModelConfig, hardware: Hardware, efficiency: Efficiency = Efficiency(),
                  parallel: ExpertParallel = ONE_GPU) -> CostModel:
    """One replica's step on ``parallel.size`` GPUs of ``hardware``, priced on its busiest rank."""
    parallel.check(model)
    n, balancedness = parallel.size, parallel.balancedness
    weight_read_bytes_per_s = hardware.hbm_bytes_per_s * efficiency.mem_efficiency
    dense_flops = hardware.bf16_flops * efficiency.mfu
    moe = model.moe
    experts = None
    if moe is not None and moe.num_moe_layers:
        one_expert = 2 * 3 * model.hidden_size * moe.intermediate_size
        experts = ExpertReads(num_layers=moe.num_moe_layers, num_experts=moe.num_experts, top_k=moe.top_k,
                              per_expert_s=one_expert / weight_read_bytes_per_s, num_ranks=n,
                              balancedness=balancedness)
    # With one rank both sums are exactly the single GPU's: (dense - whole) / 1 + whole, and so on.
    whole = replicated_bytes(model)
    dense_read_bytes = (weight_bytes(model) - expert_bytes(model) - whole) / n + whole
    routed = routed_params_per_token(model)
    params_per_token = (num_active_params(model) - routed) / n + routed / (n * balancedness)
    source = (f"analytic: {hardware.name} roofline, mfu {efficiency.mfu}, attention {efficiency.attn_efficiency}, "
              f"HBM {efficiency.mem_efficiency}")
    if n > 1:
        source += (f"; expert parallel {n} (attention split over it), {parallel.num_redundant_experts} redundant "
                   f"experts, balancedness {balancedness}, NVLink {hardware.nvlink_bytes_per_s / 2e9:.0f} GB/s "
                   f"each way, {efficiency.collective_latency_s * 1e6:.3g} µs a collective")
    return CostModel(
        base_s=dense_read_bytes / weight_read_bytes_per_s + efficiency.step_overhead_s,
        per_token_s=2 * params_per_token / dense_flops,
        per_pair_s=4 * model.num_layers * model.num_heads * model.head_dim
        / (hardware.bf16_flops * efficiency.attn_efficiency) / n,
        per_seq_s=efficiency.per_seq_s,
        per_sample_s=2 * model.hidden_size * model.vocab_size / dense_flops / n,
        per_host_byte_s=1 / hardware.host_link_bytes_per_s,
        source=source,
        experts=experts,
        collectives=collectives(model, n, hardware.nvlink_bytes_per_s / 2, efficiency.collective_latency_s,
                                dispatch=parallel.dispatch)
        if n > 1 else None,
    )


def kv_cache_bytes(model: ModelConfig, hardware: Hardware, efficiency: Efficiency = Efficiency(),
                   parallel: ExpertParallel = ONE_GPU) -> int:
    """The KV pool one GPU holds after its weights (every expert's, for an MoE; a rank's share of them under
    expert parallelism). ``ValueError`` when the weights leave nothing."""
    parallel.check(model)
    left = hardware.hbm_bytes - rank_weight_bytes(model, parallel)
    if left <= 0:
        raise ValueError(f"{rank_weight_bytes(model, parallel) / 1e9:.1f} GB of weights a rank do not fit "
                         f"{hardware.name}'s {hardware.hbm_bytes / 1e9:.0f} GB (expert parallel {parallel.size})")
    return int(left * efficiency.kv_fraction)


def link(hardware: Hardware, kind: str) -> TransferModel:
    """KV transfer between GPUs of one node (``nvlink``) or across nodes (``rdma``)."""
    if kind == "nvlink":
        return TransferModel(20e-6, 1e-6, hardware.nvlink_bytes_per_s / 2, f"analytic: {hardware.name} NVLink")
    return TransferModel(50e-6, 2e-6, hardware.nic_bytes_per_s, f"analytic: {hardware.name} RDMA NIC")
