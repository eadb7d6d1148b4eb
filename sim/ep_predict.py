"""A replica's step at expert parallelism ``n`` predicted from its step measured at 1, on the same CPU:
what an engine run at EP 1 and EP 2 on one machine can be held against.

The measured step (``sim.profile``'s ``CostModel`` of the real engine at EP 1) is split in three:

    experts  the routed experts' work: the share of ``per_token_s * T`` that is their FLOPs
             (``expert_flop_share``: routed over active parameters, from the model's shape), plus,
             when ``memory_bytes_per_s`` is given, the expert weights the step reads, E (1 - (1 - k/E)^T)
             of them a layer (``ExpertReads``), at that rate
    dense    what attention split over the ranks divides: the rest of ``per_token_s * T``, the
             attended pairs and the LM head's sampled rows (0 when attention runs whole on each rank)
    rest     the step's fixed and per-sequence time, never divided

and the busiest rank of ``n`` takes

    (rest + dense / n + experts / (n * balancedness)) * compute_slowdown + collectives

where ``collectives`` are the layout's all-to-alls and all-reduces (``sim.expert_parallel``) over the
link the ranks share, loopback on one machine (gloo: give its bandwidth and per-call latency as
measured there). Under uniform routing a rank reads exactly 1/n of the experts EP 1 reads, and
computes 1/n of their rows, so the expert part scales by 1/n whichever bounds it; what the split
cannot know is how much of the measured linear terms is expert work, so the prediction is as good
as ``expert_flop_share`` and ``memory_bytes_per_s`` describe the engine.

Inputs: ``measured``, the EP 1 profile at the threads *one rank* computes on at EP ``n`` (two ranks
on a 2-core machine: ``sim.profile --threads 1``); ``model``, the checkpoint's ``ModelConfig``;
``size``, the EP size; ``attention_split``, whether ``tensor_parallel_size`` equals it (else 1);
``link_bytes_per_s`` and ``latency_s``, one collective's bandwidth each way and fixed cost;
``memory_bytes_per_s``, the rate the expert weights are read at (``bench.moe``'s stream bound), or
None to take the expert part from FLOPs alone; ``dtype_bytes``, the activations' and expert weights'
bytes (4 where the CPU holds the experts in fp32); ``balancedness``, as ``ExpertParallel`` takes it;
``compute_slowdown``, how much slower a rank computes while the others do (1.0 on cores of their own;
``n`` over the ranks' measured parallel speedup where they share a core's units, as two vCPUs can).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.model.config import ModelConfig
from sim.cost import Collectives, CostModel, ExpertReads, StepShape
from sim.expert_parallel import ExpertParallel, collectives
from sim.params import num_active_params, routed_params_per_token


@dataclass(frozen=True)
class StepParts:
    """One step's seconds as the prediction splits it (EP 1's parts, and the prediction at EP ``n``)."""

    measured_s: float
    experts_s: float
    dense_s: float
    collectives_s: float
    predicted_s: float


@dataclass(frozen=True)
class ExpertParallelPrediction:
    """The module's split of a measured EP 1 step, and the busiest rank's step at ``size`` ranks."""

    measured: CostModel
    size: int
    expert_flop_share: float
    attention_split: bool
    balancedness: float
    compute_slowdown: float
    reads: ExpertReads | None  # EP 1's expert reads at the memory rate, when given
    collectives: Collectives | None  # None with one rank

    def parts(self, shape: StepShape) -> StepParts:
        m = self.measured
        measured_s = m.step_seconds(shape)
        token_s = m.per_token_s * shape.num_tokens
        experts_s = self.expert_flop_share * token_s
        if self.reads is not None:
            experts_s += self.reads.seconds(shape.num_tokens)
        experts_s = min(experts_s, measured_s)  # an estimate never above what was measured
        dense_s = 0.0
        if self.attention_split:
            dense_s = ((1 - self.expert_flop_share) * token_s + m.per_pair_s * shape.attn_pairs
                       + m.per_sample_s * shape.num_samples)
            dense_s = min(dense_s, measured_s - experts_s)
        collectives_s = self.collectives.seconds(shape.num_tokens, shape.num_samples) if self.collectives else 0.0
        n = self.size
        compute_s = measured_s - experts_s * (1 - 1 / (n * self.balancedness)) - dense_s * (1 - 1 / n)
        predicted_s = compute_s * self.compute_slowdown + collectives_s
        return StepParts(measured_s, experts_s, dense_s, collectives_s, predicted_s)

    def step_seconds(self, shape: StepShape) -> float:
        return self.parts(shape).predicted_s


def predict_expert_parallel(measured: CostModel, model: ModelConfig, size: int = 2, *, attention_split: bool,
                            link_bytes_per_s: float, latency_s: float, memory_bytes_per_s: float | None = None,
                            dtype_bytes: int = 2, balancedness: float = 1.0,
                            compute_slowdown: float = 1.0, dispatch: str = "all_reduce") -> ExpertParallelPrediction:
    """The busiest rank's step at ``size`` expert-parallel ranks on the CPU ``measured`` ran on (see the module)."""
    moe = model.moe
    if moe is None or not moe.num_moe_layers:
        raise ValueError(f"{model.architecture} has no experts to spread")
    (ExpertParallel(size, 0, balancedness) if size > 1 else ExpertParallel()).check(model, attention_split)
    if compute_slowdown < 1.0:
        raise ValueError(f"compute_slowdown must be >= 1.0 (ranks never compute faster together), got "
                         f"{compute_slowdown}")
    if memory_bytes_per_s is not None and memory_bytes_per_s <= 0:
        raise ValueError(f"memory_bytes_per_s must be > 0 or None, got {memory_bytes_per_s}")
    reads = None
    if memory_bytes_per_s is not None:
        one_expert = dtype_bytes * 3 * model.hidden_size * moe.intermediate_size
        reads = ExpertReads(num_layers=moe.num_moe_layers, num_experts=moe.num_experts, top_k=moe.top_k,
                            per_expert_s=one_expert / memory_bytes_per_s)
    return ExpertParallelPrediction(
        measured=measured, size=size, expert_flop_share=routed_params_per_token(model) / num_active_params(model),
        attention_split=attention_split, balancedness=balancedness, compute_slowdown=compute_slowdown, reads=reads,
        collectives=collectives(model, size, link_bytes_per_s, latency_s, attention_split=attention_split,
                                dispatch=dispatch,
                                dtype_bytes=dtype_bytes) if size > 1 else None)
