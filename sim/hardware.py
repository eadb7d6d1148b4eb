"""Analytic step costs for GPUs we have no profile of: a roofline from datasheet peaks and stated efficiencies.

For a decoder of ``P`` non-embedding parameters (plus the LM head) in bf16,
one engine step costs

    base_s       = weight bytes / (HBM bandwidth * mem_efficiency)     every step reads every weight once
                   + step_overhead_s                                   launch, scheduling, sampling setup
    per_token_s  = 2 * P / (bf16 FLOP/s * mfu)                         the dense layers, per token
    per_pair_s   = 2 * layers * heads * (qk_dim + v_dim) / (bf16 FLOP/s * attn_efficiency)
                                                                       QK^T and PV, per query-key pair
    per_sample_s = 2 * hidden * vocab / (bf16 FLOP/s * mfu)            the LM head, per sampled row

and the step's time is their sum (``sim.cost``). A sum, not a max: a step
that is both memory- and compute-heavy is charged for both, which
overstates mid-sized batches by at most 2x. Every such profile says
``analytic`` in its ``source``, with the efficiencies it assumed. Parameters
and bytes by part are ``sim.params``'.

An 8-bit checkpoint (DeepSeek-V3's block FP8) reads its decoder layers'
linear weights in one byte each and computes them at the 8-bit tensor-core
rate (``Hardware.fp8_flops``); its embeddings, LM head and routers stay
16-bit, and so do attention and the KV pool.

A mixture of experts differs in two places. ``P`` in ``per_token_s`` is
its *active* parameters (``num_active_params``: attention, dense layers'
MLPs, and per MoE layer the router, ``top_k`` experts and any shared
expert); ``base_s`` reads every weight but the routed experts, and
``CostModel.experts`` reads, per MoE layer, the experts the step's tokens
touch (``ExpertReads``: k of E at one token, all E for a long prefill), at
the same bandwidth. Memory holds every expert (``weight_bytes``), so the
KV pool is what the whole checkpoint leaves.

Multi-head latent attention (DeepSeek-V2/V3, ``ModelConfig.mla``) keeps one
latent row a token and layer (``kv_lora_rank + qk_rope_head_dim`` values) and
attends two ways. A prompt's chunk attends decompressed: kv_b expands the
latents to per-head keys and values, so ``per_pair_s`` is the formula above
with MLA's head dims (192 and 128 for V3). A decode attends with the weights
absorbed: each head's query, taken into the latent space by ``W_UK``, scores
the latent rows and its output leaves it by ``W_UV`` (both per token, kv_b's
parameters in ``P``), so a pair costs ``2 * layers * heads * (latent_dim +
kv_lora_rank)`` FLOPs and reads ``layers * latent_dim`` bytes of the pool:
``CostModel.decode_pair_s``, the pairs' price in a step whose every
sequence computes one token. Left out: the kv_b expansion of a chunk's
cached context (a chunk of n tokens after c expands c latent rows, ``2 *
kv_lora_rank * heads * (nope + v)`` FLOPs a row and layer: 410/n more than
the chunk's pairs with that context at V3's shape, 5% at n = 8,192), and
the decodes that share a step with a prompt's chunk, priced at the chunk's
rate.

Expert parallelism over ``n`` GPUs (``sim.expert_parallel.ExpertParallel``:
attention split over the same ranks) is priced on the busiest rank:
``base_s`` reads the dense weights' 1/n and the routers, shared experts and
MLA's down-projections whole; ``per_token_s`` computes the dense FLOPs' 1/n
(the router and shared expert run on the rank's 1/n of the tokens) and the
routed experts' 1/(n * balancedness); ``per_pair_s`` and ``per_sample_s``
are split n ways, and ``decode_pair_s``'s FLOPs too, but not its bytes:
each rank's heads read the whole latent, which every rank keeps;
``ExpertReads`` counts one rank's experts, (E/n)(1 - (1 - k/E)^T), over the
balancedness; and ``Collectives`` adds the all-to-alls and all-reduces over
NVLink (one direction of ``nvlink_bytes_per_s``), each with
``Efficiency.collective_latency_s``. Each rank holds its dense share, the
replicated parts and (E + R)/n experts (``rank_weight_bytes``); its KV pool
is what they leave.

Datasheet figures (dense bf16 and FP8 tensor-core FLOP/s without sparsity,
HBM bandwidth, NVLink per GPU both directions, the NIC each GPU usually
gets). NVLink: A100 NVLink 3, 600 GB/s; H100 and H200 NVLink 4, 900 GB/s (18
links of 50 GB/s, 450 GB/s each way; NVIDIA's H100 and H200 datasheets);
B200 NVLink 5, 1.8 TB/s. An all-to-all in one NVSwitch node reaches nearly
one direction's rate: DeepEP's intranode dispatch and combine at EP 8 run at
153 and 158 GB/s on H800s, whose NVLink gives about 160 GB/s each way
(github.com/deepseek-ai/DeepEP, README).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.model.config import ModelConfig
from sim.cost import CostModel, ExpertReads
from sim.expert_parallel import ExpertParallel, collectives
from sim.models import MODELS, model_dir  # noqa: F401  (re-exported: the presets' home is sim.models)
from sim.params import (  # noqa: F401  (re-exported: the counts' home is sim.params)
    ONE_GPU,
    decode_pair_bytes,
    decode_pair_flops,
    expert_bytes,
    kv_bytes_per_token,
    num_active_params,
    num_params,
    one_expert_bytes,
    prefill_pair_flops,
    rank_weight_bytes,
    replicated_bytes,
    routed_params_per_token,
    weight_bytes,
)
from sim.transport import TransferModel

KV_DTYPE_BYTES = 2  # the pool's dtype: the activations' (kv_cache_dtype "auto"), bf16


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float  # per GPU, both directions
    nic_bytes_per_s: float
    host_link_bytes_per_s: float  # host memory <-> GPU, one direction, pinned: PCIe x16 at ~80% of its rate
    # The rate an 8-bit checkpoint's products run at: dense FP8 (INT8 runs at the same rate on H100 and H200).
    fp8_flops: float = 0.0

    def linear_flops(self, model: ModelConfig) -> float:
        """Peak FLOP/s of ``model``'s linear layers: the 8-bit rate for an 8-bit checkpoint, where there is one."""
        return self.fp8_flops if model.quantization is not None and self.fp8_flops else self.bf16_flops


HARDWARE = {
    # No FP8 tensor cores: an 8-bit checkpoint is priced at the bf16 rate.
    "a100": Hardware("A100 SXM 80GB", 312e12, 2.039e12, 80e9, 600e9, 25e9, 25e9),  # PCIe Gen4
    "h100": Hardware("H100 SXM", 989e12, 3.35e12, 80e9, 900e9, 50e9, 50e9, fp8_flops=1979e12),  # PCIe Gen5
    "h200": Hardware("H200 SXM", 989e12, 4.8e12, 141e9, 900e9, 50e9, 50e9, fp8_flops=1979e12),
    "b200": Hardware("B200", 2250e12, 8.0e12, 180e9, 1800e9, 50e9, 50e9, fp8_flops=4500e12),
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


def analytic_cost(model: ModelConfig, hardware: Hardware, efficiency: Efficiency = Efficiency(),
                  parallel: ExpertParallel = ONE_GPU) -> CostModel:
    """One replica's step on ``parallel.size`` GPUs of ``hardware``, priced on its busiest rank."""
    parallel.check(model)
    n, balancedness = parallel.size, parallel.balancedness
    weight_read_bytes_per_s = hardware.hbm_bytes_per_s * efficiency.mem_efficiency
    linear_flops = hardware.linear_flops(model) * efficiency.mfu
    attention_flops = hardware.bf16_flops * efficiency.attn_efficiency
    moe = model.moe
    experts = None
    if moe is not None and moe.num_moe_layers:
        experts = ExpertReads(num_layers=moe.num_moe_layers, num_experts=moe.num_experts, top_k=moe.top_k,
                              per_expert_s=one_expert_bytes(model) / weight_read_bytes_per_s, num_ranks=n,
                              balancedness=balancedness)
    # With one rank both sums are exactly the single GPU's: (dense - whole) / 1 + whole, and so on.
    whole = replicated_bytes(model)
    dense_read_bytes = (weight_bytes(model) - expert_bytes(model) - whole) / n + whole
    routed = routed_params_per_token(model)
    params_per_token = (num_active_params(model) - routed) / n + routed / (n * balancedness)
    source = (f"analytic: {hardware.name} roofline, mfu {efficiency.mfu}, attention {efficiency.attn_efficiency}, "
              f"HBM {efficiency.mem_efficiency}")
    if model.quantization is not None:
        source += f"; 8-bit linear layers at {linear_flops / efficiency.mfu / 1e12:.0f} TFLOP/s"
    if n > 1:
        source += (f"; expert parallel {n} (attention split over it), {parallel.num_redundant_experts} redundant "
                   f"experts, balancedness {balancedness}, NVLink {hardware.nvlink_bytes_per_s / 2e9:.0f} GB/s "
                   f"each way, {efficiency.collective_latency_s * 1e6:.3g} µs a collective")
    decode_pair_s = None
    if model.mla is not None:  # FLOPs over the rank's heads; every rank reads the whole latent
        decode_pair_s = (decode_pair_flops(model) / attention_flops / n
                         + decode_pair_bytes(model, KV_DTYPE_BYTES) / weight_read_bytes_per_s)
        source += "; MLA: prompts attend decompressed, decodes absorbed"
    return CostModel(
        base_s=dense_read_bytes / weight_read_bytes_per_s + efficiency.step_overhead_s,
        per_token_s=2 * params_per_token / linear_flops,
        per_pair_s=prefill_pair_flops(model) / attention_flops / n,
        per_seq_s=efficiency.per_seq_s,
        per_sample_s=2 * model.hidden_size * model.vocab_size / (hardware.bf16_flops * efficiency.mfu) / n,
        per_host_byte_s=1 / hardware.host_link_bytes_per_s,
        source=source,
        experts=experts,
        collectives=collectives(model, n, hardware.nvlink_bytes_per_s / 2, efficiency.collective_latency_s,
                                dispatch=parallel.dispatch)
        if n > 1 else None,
        decode_pair_s=decode_pair_s,
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
