"""Expert parallelism inside a replica: each rank holds some experts, and tokens reach them by all-to-all.

Every rank holds the whole batch's hidden states when an MoE block starts
(attention is split over the ranks and all-reduced, or whole on each), so rank
``r`` takes the ``r``-th even, contiguous slice of the batch's tokens
(``token_slice``). For its slice it:

1. routes (the router is replicated: ``pd_kernels.select_experts``) and counts
   each expert's tokens (``ExpertLoad``, what EPLB places by);
2. picks one replica of each (token, expert) pair's expert: replica
   ``token % replicas``, by the token's index in the batch, so the choice is
   deterministic and a hot expert's tokens spread over its replicas;
3. **dispatch**: sends each pair's hidden row to its replica's rank, in one
   all-to-all, its pairs sorted by slot; an all-to-all of the counts per slot
   gave the split sizes first, and tells each receiver its rows' experts (a
   rank may send or receive nothing);
4. runs the rows it received through its own experts (``pd_kernels.fused_moe``,
   one expert a row);
5. **combine**: the reverse all-to-all brings each pair's output back, in the
   order it left;
6. weights and sums each token's pairs in routing order, adds the shared
   expert (held whole by every rank) for its slice, and writes its slice of a
   block output that is zero elsewhere.

One all-reduce of that output, the block's as under tensor parallelism, gives
every rank every token's output. Per MoE layer a rank makes four collectives
(the counts per slot, dispatch, combine, the all-reduce) and sends ``k * H``
activations per token of its slice to dispatch, and receives as many back.

**Rebalancing** (``sync_load``, ``move_layer``) is collective too: the driver
asks for it between steps (``pd.engine.ep.schedule``) and every rank runs it
at the same point. The ranks all-reduce their load counts, so each computes
the same new placement, then move a layer's experts a few at a time, one
all-to-all per weight (``pd.engine.ep.moves``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

import pd_kernels
from pd.config import EPLB_WINDOW_BUCKETS
from pd.engine.ep.load import ExpertLoad
from pd.engine.ep.moves import Move, StagedMove, align, receives, sends
from pd.engine.ep.placement import Placement, balancedness, check_placement_args, rebalance, static_placement
from pd.model.config import ModelConfig, MoeConfig
from pd.model.moe import MoeWeights, route

# How an MoE block reaches the experts: each pair's row sent to its expert's rank and back (all-to-alls),
# or run where it already is, every rank holding every token's row (the decisions all-gathered).
DISPATCHES = ("all_to_all", "all_reduce")


class ExpertGroup(Protocol):
    """The collectives expert parallelism makes (``pd.engine.tp.group.TPGroup``)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...


def check_ep(model: ModelConfig, size: int, num_redundant: int) -> None:
    """Raise ``ValueError`` naming why ``size`` expert-parallel ranks cannot hold ``model``'s experts."""
    if size == 1:
        return
    if model.moe is None:
        raise ValueError(f"expert_parallel_size {size}: the model ({model.architecture}) has no experts; expert "
                         "parallelism is for mixture-of-experts models")
    check_placement_args(model.moe.num_experts, size, num_redundant, 1, 1)


def token_slice(num_tokens: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s tokens of a batch: ``ceil(num_tokens / size)`` a rank, the last ones fewer or none."""
    per = -(-num_tokens // size)
    return min(rank * per, num_tokens), min((rank + 1) * per, num_tokens)


def initial_placement(num_experts: int, num_ranks: int, num_redundant: int) -> Placement:
    """The placement before any load is known: contiguous experts, or EPLB's on a uniform load when there
    are redundant slots to fill."""
    if num_redundant == 0:
        return static_placement(num_experts, num_ranks)
    return rebalance([1.0] * num_experts, num_ranks, num_redundant)


@dataclass
class _Table:
    """A placement as the dispatch reads it: each expert's replicas as physical ids (rank * slots + slot)."""

    placement: Placement
    replicas: torch.Tensor  # int64 [E, max replicas], padded with the first replica
    counts: torch.Tensor  # int64 [E]

    @classmethod
    def of(cls, placement: Placement, device: torch.device) -> "_Table":
        slots = len(placement.slots[0])
        ids = [[rank * slots + slot for rank, slot in placement.replicas(e)] for e in range(placement.num_experts)]
        width = max(len(r) for r in ids)
        padded = [r + [r[0]] * (width - len(r)) for r in ids]
        return cls(placement, torch.tensor(padded, dtype=torch.int64, device=device),
                   torch.tensor([len(r) for r in ids], dtype=torch.int64, device=device))


class ExpertParallel:
    """One rank's side of expert parallelism: the placements, the load window, the MoE block's all-to-alls."""

    def __init__(self, group: ExpertGroup, num_layers: int, moe_layers: list[int], num_experts: int,
                 num_redundant: int, window_steps: int, window_buckets: int, device: torch.device,
                 dispatch: str = "all_reduce"):
        if dispatch not in DISPATCHES:
            raise ValueError(f"expert_dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.dispatch = dispatch
        self.group = group
        self.num_experts = num_experts
        self.num_redundant = num_redundant
        self.moe_layers = moe_layers
        self.device = device
        first = initial_placement(num_experts, group.size, num_redundant)
        self.tables = {layer: _Table.of(first, device) for layer in moe_layers}
        self.load = ExpertLoad(num_layers, num_experts, window_steps, window_buckets, device)
        self.global_load: torch.Tensor | None = None  # the ranks' loads added up, as of the last sync
        self.move_seconds: list[float] = []  # each layer move's time on this rank, the latest last
        self._staged: StagedMove | None = None  # a layer's move under way
        self.move_part_max_s = 0.0  # the longest any one step waited for a part of a move
        # This rank's own experts' work, cumulative: the rows they ran and (on CPU, where it is the
        # compute's) the seconds; every rank's as of the last sync, for finding the slowest.
        self.expert_rows = 0
        self.expert_seconds = 0.0
        self.block_seconds = 0.0  # the MoE blocks' whole time: the experts, routing, the collectives
        self.rank_expert_rows: list[int] = []
        self.rank_expert_seconds: list[float] = []
        self.rank_block_seconds: list[float] = []

    @classmethod
    def for_model(cls, group: ExpertGroup, model: ModelConfig, config, device: torch.device) -> "ExpertParallel":
        """Rank ``group.rank`` of an engine's expert parallelism (``config``: its ``EngineConfig``)."""
        check_ep(model, group.size, config.num_redundant_experts)
        moe_layers = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
        return cls(group, model.num_layers, moe_layers, model.moe.num_experts, config.num_redundant_experts,
                   config.eplb_window_steps, EPLB_WINDOW_BUCKETS, device, config.expert_dispatch)

    @property
    def slots_per_rank(self) -> int:
        return (self.num_experts + self.num_redundant) // self.group.size

    def held(self, layer: int) -> tuple[int, ...]:
        """The logical experts this rank holds in ``layer``, in slot order."""
        return self.tables[layer].placement.slots[self.group.rank]

    def placement(self, layer: int) -> Placement:
        return self.tables[layer].placement

    # The MoE block.

    def moe_block(self, layer: int, weights: MoeWeights, config: MoeConfig, hidden: torch.Tensor,
                  num_tokens: int, backend: str) -> torch.Tensor:
        """The block's output for every row of ``hidden`` (all-reduced over the ranks; padding rows zero)."""
        started = time.perf_counter()
        start, stop = token_slice(num_tokens, self.group.rank, self.group.size)
        x = hidden[start:stop]
        if stop > start:
            topk_weights, topk_ids = route(weights, config, x)
            self.load.add(layer, topk_ids)
        else:  # no tokens here; the all-to-alls still bring this rank's experts their rows
            topk_weights = torch.empty(0, config.top_k, device=x.device)
            topk_ids = torch.empty(0, config.top_k, dtype=torch.int64, device=x.device)
        out = hidden.new_zeros(hidden.shape)
        if self.dispatch == "all_to_all":
            out[start:stop] = self._exchange(layer, weights, x, topk_ids, topk_weights.to(hidden.dtype), start,
                                             backend)
        else:
            self._local_pairs(layer, weights, hidden, num_tokens, topk_ids, topk_weights.to(hidden.dtype), out,
                              backend)
        if weights.shared_gate_up is not None and stop > start:
            shared = weights.shared_down(pd_kernels.silu_and_mul(weights.shared_gate_up(x), backend=backend))
            out[start:stop] += shared if weights.shared_expert_gate is None else shared.mul_(
                torch.sigmoid(weights.shared_expert_gate(x)))
        out = self.group.all_reduce(out)
        self.block_seconds += time.perf_counter() - started
        return out

    def _exchange(self, layer: int, weights: MoeWeights, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, start: int, backend: str) -> torch.Tensor:
        """Dispatch, the local experts, combine: each of ``x``'s tokens' weighted sum of its experts' outputs."""
        table, size, hidden = self.tables[layer], self.group.size, x.shape[1]
        num_tokens, top_k = topk_ids.shape
        experts = topk_ids.reshape(-1)
        token = torch.arange(start, start + num_tokens, device=x.device).repeat_interleave(top_k)
        physical = table.replicas[experts, token % table.counts[experts]]  # rank * slots + slot
        # Pairs sorted by rank, then slot: a rank's counts per slot tell its receiver each row's expert.
        order = torch.argsort(physical, stable=True)
        slots = self.slots_per_rank
        send_counts = torch.bincount(physical, minlength=size * slots)
        recv_counts = torch.empty_like(send_counts)
        self.group.all_to_all(recv_counts, send_counts, [], [])
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).view(2, size, slots).sum(dim=2).tolist()
        received = x.new_empty(sum(recv_splits), hidden)
        self.group.all_to_all(received, x[order // top_k], recv_splits, send_splits)
        local_ids = torch.arange(slots, device=x.device).repeat(size).repeat_interleave(recv_counts)
        outputs = x.new_empty(sum(recv_splits), hidden)
        if outputs.shape[0]:
            ones = torch.ones(outputs.shape[0], dtype=x.dtype, device=x.device)
            outputs = self._run_experts(weights, received, local_ids, ones, backend)
        back = x.new_empty(order.shape[0], hidden)
        self.group.all_to_all(back, outputs, send_splits, recv_splits)
        pairs = torch.empty_like(back)
        pairs[order] = back
        return (pairs.view(num_tokens, top_k, hidden) * topk_weights.unsqueeze(-1)).sum(dim=1)

    def _local_pairs(self, layer: int, weights: MoeWeights, hidden: torch.Tensor, num_tokens: int,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, backend: str) -> None:
        """``expert_dispatch: all_reduce``: every rank learns every token's routing (one all-gather of the
        slices' decisions, each made by one rank), runs the pairs whose replica it holds on the rows it
        already has, and adds their weighted outputs into ``out`` (the block's all-reduce sums the ranks)."""
        size, top_k, per = self.group.size, topk_ids.shape[1], -(-num_tokens // self.group.size)
        decisions = torch.zeros(per, top_k, 2, dtype=torch.float64, device=hidden.device)
        decisions[:topk_ids.shape[0], :, 0] = topk_ids
        decisions[:topk_ids.shape[0], :, 1] = topk_weights
        every = self.group.all_gather(decisions).view(size * per, top_k, 2)[:num_tokens]
        experts, pair_weights = every[..., 0].long().reshape(-1), every[..., 1].to(hidden.dtype).reshape(-1)
        table, slots = self.tables[layer], self.slots_per_rank
        token = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
        physical = table.replicas[experts, token % table.counts[experts]]
        mine = torch.nonzero(torch.div(physical, slots, rounding_mode="floor") == self.group.rank).squeeze(1)
        if mine.numel():
            rows = token[mine]
            outputs = self._run_experts(weights, hidden[rows], physical[mine] % slots, pair_weights[mine], backend)
            out.index_add_(0, rows, outputs)

    def _run_experts(self, weights: MoeWeights, rows: torch.Tensor, local_ids: torch.Tensor,
                     row_weights: torch.Tensor, backend: str) -> torch.Tensor:
        """Each row through its one local expert, times its weight (``pd_kernels.fused_moe``, top-1)."""
        started = time.perf_counter()
        compute = weights.compute_dtype
        outputs = pd_kernels.fused_moe(rows.to(compute), weights.w13, weights.w2, local_ids[:, None],
                                    row_weights[:, None].to(compute), backend=backend).to(rows.dtype)
        self.expert_rows += outputs.shape[0]
        self.expert_seconds += time.perf_counter() - started
        return outputs

    def end_step(self) -> None:
        self.load.end_step()

    # Statistics and rebalancing: collective, every rank at the same step boundary.

    def sync_load(self) -> None:
        """Add up the ranks' load windows (every rank then holds the same ``global_load``), and gather each
        rank's expert work so far."""
        self.global_load = self.group.all_reduce(self.load.counts().clone())
        work = torch.zeros(3, self.group.size, dtype=torch.float64, device=self.device)
        work[:, self.group.rank] = torch.tensor([self.expert_rows, self.expert_seconds, self.block_seconds])
        rows, seconds, blocks = self.group.all_reduce(work).tolist()
        self.rank_expert_rows, self.rank_expert_seconds = [int(r) for r in rows], seconds
        self.rank_block_seconds = blocks

    def move_layer(self, layer: int, weights: MoeWeights, max_moves: int = 0) -> bool:
        """Move ``layer``'s experts toward their placement by the last synced load: at most ``max_moves``
        experts between ranks this call (0: all). True once the layer runs on its new placement (at once
        when it stays); until then it runs on the old one, and the next call goes on where this one stopped.

        Only the arriving experts are staged (``StagedMove``); each call's share arrives in one all-to-all
        per weight, so a step waits for at most ``max_moves`` experts' bytes.
        """
        started = time.perf_counter()
        staged = self._staged
        if staged is None or staged.layer != layer:
            if self.global_load is None:
                self.sync_load()
            load = [float(v) for v in self.global_load[layer].tolist()]
            old = self.tables[layer].placement
            new = align(old, rebalance(load, self.group.size, self.num_redundant))
            if new == old:
                return True
            staged = self._staged = StagedMove.start(layer, old, new, weights, self.group.rank)
        chunk = staged.cross[staged.done:staged.done + max_moves] if max_moves else staged.cross[staged.done:]
        for weight, into in ((weights.w13, staged.w13), (weights.w2, staged.w2)):
            self._exchange_weights(chunk, weight, into, staged.rows)
        staged.done += len(chunk)
        if staged.done == len(staged.cross):
            staged.install(weights, self.group.rank)
            self.tables[layer] = _Table.of(staged.new, self.device)
            self._staged = None
        part = time.perf_counter() - started
        staged.seconds += part
        self.move_part_max_s = max(self.move_part_max_s, part)
        if self._staged is not None:
            return False
        self.move_seconds.append(staged.seconds)
        return True

    def _exchange_weights(self, moves: list[Move], weight: torch.Tensor, into: torch.Tensor,
                          rows: dict[tuple[int, int], int]) -> None:
        """Carry out ``moves`` (between ranks) of one weight ``[slots, ...]``: this rank's sends from
        ``weight``, its receives into their ``rows`` of ``into``."""
        rank, size = self.group.rank, self.group.size
        out_parts, in_parts = sends(moves, rank, size), receives(moves, rank, size)
        row = weight[0].numel()
        outgoing = [weight[m.src_slot].reshape(-1) for part in out_parts for m in part]
        send = torch.stack(outgoing) if outgoing else weight.new_empty(0, row)
        received = weight.new_empty(sum(map(len, in_parts)), row)
        self.group.all_to_all(received, send, [len(p) for p in in_parts], [len(p) for p in out_parts])
        for i, m in enumerate(m for part in in_parts for m in part):
            into[rows[(m.src_rank, m.dst_slot)]] = received[i].view(weight.shape[1:])

    def stats(self) -> dict:
        """Balancedness (mean over max load per rank) per MoE layer, and each expert's load, as of the last
        sync; empty before the first."""
        if self.global_load is None:
            return {}
        loads = self.global_load.tolist()
        per_layer = {layer: balancedness(self.tables[layer].placement.rank_loads([float(v) for v in loads[layer]]))
                     for layer in self.moe_layers}
        return {"balancedness": per_layer, "expert_load": {layer: loads[layer] for layer in self.moe_layers},
                "move_seconds": list(self.move_seconds), "move_part_max_s": self.move_part_max_s,
                "rank_expert_rows": list(self.rank_expert_rows),
                "rank_expert_seconds": list(self.rank_expert_seconds),
                "rank_block_seconds": list(self.rank_block_seconds)}
