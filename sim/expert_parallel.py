"""Expert parallelism's layout and traffic: one replica over ``n`` GPUs, a mixture of experts' experts
spread over them, attention split over the same ranks (``tensor_parallel_size`` equal to
``expert_parallel_size``, one of the two layouts ``pd.config.EngineConfig`` takes).

Rank r of n holds the dense weights' 1/n (attention heads, the vocabulary, dense MLPs: as
``pd.model.tp`` splits them), the router and any shared expert whole, and (E + R) / n of every MoE
layer's experts (R redundant replicas, which EPLB gives to the busiest experts). One MoE layer of a
step of T tokens, as ``pd.engine.ep.dispatch`` runs it:

    attention (each rank its heads, all T tokens) ── all-reduce: every rank has all T tokens
      │
      v  rank r takes its slice, T/n tokens: router, then, after an all-to-all of the split sizes,
    dispatch: each (token, expert) pair's activations to the rank of a replica of its expert
      │
      v  each rank runs the rows it received through its experts
    combine: each pair's output back to the rank that sent it; each token's pairs summed
      │
      v
    all-reduce of the block's output (zero outside each rank's slice): every rank has all T tokens

The split sizes are a few integers a rank (a latency, no bytes to speak of). A rank sends, per token
of its slice and per MoE layer, k * hidden * bytes * (n-1)/n in the dispatch
(under uniform routing (n-1)/n of a token's experts live elsewhere) and as much in the combine; each
all-reduce sends 2 (n-1)/n * hidden * bytes per token of the step (a ring's reduce-scatter and
all-gather). A dense-MLP layer all-reduces attention's output and the MLP's; the embedding is
all-reduced once; each rank's logits (fp32, V/n columns) are gathered to rank 0. Per token of the
step a rank's slice is 1/n of a token (``token_slice`` gives the last ranks one fewer when n does
not divide T; the expectation is priced).

``dispatch="all_reduce"`` (the engine's default, ``EngineConfig.expert_dispatch``) prices the other
way the engine reaches the experts: each rank decides its slice's routing, one all-gather gives every
rank every decision (k ids and weights a token: 16 k bytes), and each rank runs the pairs whose expert
it holds on the rows it already has; the block's all-reduce then sums them. Per MoE layer that is the
all-gather and the all-reduce in place of the split sizes, the dispatch and the combine.

``attention_split=False`` prices the other layout (``tensor_parallel_size`` 1: every rank runs the
whole batch's attention and dense layers): per MoE layer the split sizes' exchange, the dispatch, the
combine and the block's all-reduce, and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.model.config import ModelConfig
from pd.model.tp import check_tp
from sim.cost import Collectives

LOGITS_BYTES = 4  # the logits are gathered in fp32 (pd.engine.tp.group.TPGroup.gather_logits)
DECISION_BYTES = 16  # an expert id and its weight, float64 each, in the all_reduce dispatch's all-gather
DISPATCHES = ("all_to_all", "all_reduce")  # pd.engine.ep.dispatch.DISPATCHES


@dataclass(frozen=True)
class ExpertParallel:
    """A replica's ranks: ``size`` GPUs, experts spread over them and attention split over them.

    ``balancedness`` is the placement's mean over max tokens per rank
    (``pd.engine.ep.placement.balancedness``): the busiest rank's expert work
    is the mean rank's over it. 1.0 is perfect balance, what uniform routing
    gives in expectation; the caller gives a placement's figure (redundant
    experts placed by EPLB raise it: ``tests/pd/test_ep_placement.py``'s
    skewed router goes from 0.83 to 0.96 with 2 redundant experts on 2 ranks).
    Redundant experts cost memory on every rank here; their effect on the
    balance is the caller's ``balancedness``.
    """

    size: int = 1
    num_redundant_experts: int = 0
    balancedness: float = 1.0
    dispatch: str = "all_reduce"  # as ``EngineConfig.expert_dispatch``

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.size < 1 or self.num_redundant_experts < 0 or not 0 < self.balancedness <= 1:
            raise ValueError(f"expert parallelism needs size >= 1, num_redundant_experts >= 0 and balancedness "
                             f"in (0, 1], got {self}")
        if self.size == 1 and (self.num_redundant_experts or self.balancedness != 1):
            raise ValueError(f"one rank holds every expert once and is balanced by definition, got {self}")

    def check(self, model: ModelConfig, attention_split: bool = True) -> None:
        """Raise ``ValueError`` naming what ``model`` cannot be split into on ``size`` ranks."""
        if self.size == 1:
            return
        if model.moe is None or not model.moe.num_moe_layers:
            raise ValueError(f"expert parallelism {self.size} needs a mixture of experts; {model.architecture} "
                             "has no MoE layer")
        physical = model.moe.num_experts + self.num_redundant_experts
        if physical % self.size:
            raise ValueError(f"{model.moe.num_experts} experts plus {self.num_redundant_experts} redundant ones "
                             f"({physical}) do not divide over {self.size} expert-parallel ranks")
        if attention_split:
            check_tp(model, self.size, experts=False)


def all_to_all_bytes_per_token(model: ModelConfig, size: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank sends per token of its slice, per MoE layer: the dispatch and the combine together,
    2 * top_k * hidden * dtype_bytes * (size - 1) / size under uniform routing."""
    if model.moe is None:
        raise ValueError(f"{model.architecture} has no experts to dispatch to")
    return 2 * model.moe.top_k * model.hidden_size * dtype_bytes * (size - 1) / size


def all_reduce_bytes_per_token(model: ModelConfig, size: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank sends per token all-reduced (a ring's reduce-scatter and all-gather, (n-1)/n each)."""
    return 2 * model.hidden_size * dtype_bytes * (size - 1) / size


def collectives(model: ModelConfig, size: int, link_bytes_per_s: float, latency_s: float, *,
                attention_split: bool = True, dtype_bytes: int = 2, dispatch: str = "all_reduce") -> Collectives:
    """One step's traffic between a replica's ``size`` ranks, on one rank (the module's account).

    Per token of the step a rank's slice holds 1/size of a token, so it sends
    ``all_to_all_bytes_per_token / size`` per MoE layer (``dispatch="all_to_all"``), or
    ``DECISION_BYTES * k * (size-1)/size`` of routing decisions (``"all_reduce"``); the all-reduces
    carry every token.
    """
    moe = model.moe
    num_moe = moe.num_moe_layers if moe is not None else 0
    num_dense = model.num_layers - num_moe
    all_reduce = all_reduce_bytes_per_token(model, size, dtype_bytes)
    if dispatch == "all_to_all":  # the split sizes, dispatch, combine
        reach, reach_bytes = 3, all_to_all_bytes_per_token(model, size, dtype_bytes) / size if num_moe else 0.0
    else:  # the all-gather of the routing decisions
        reach, reach_bytes = 1, DECISION_BYTES * moe.top_k * (size - 1) / size if num_moe else 0.0
    if attention_split:
        # MoE layer: attention's all-reduce, reaching the experts, the block's all-reduce; dense layer: two
        # all-reduces; the embedding's all-reduce; the logits' gather.
        return Collectives(
            num_collectives=(reach + 2) * num_moe + 2 * num_dense + 2,
            bytes_per_token=num_moe * (reach_bytes + 2 * all_reduce) + (2 * num_dense + 1) * all_reduce,
            bytes_per_sample=LOGITS_BYTES * model.vocab_size * (size - 1) / size,
            link_bytes_per_s=link_bytes_per_s, latency_s=latency_s)
    # Attention whole on every rank: per MoE layer reaching the experts and the block's all-reduce.
    return Collectives(num_collectives=(reach + 1) * num_moe, bytes_per_token=num_moe * (reach_bytes + all_reduce),
                       bytes_per_sample=0.0, link_bytes_per_s=link_bytes_per_s, latency_s=latency_s)
