"""Which expert weights move where when one layer's placement changes (a pure plan every rank computes alike).

For each rank's new slots: an expert the rank already holds is copied from its
own old slot; any other comes from a rank that held it, chosen by the
destination's rank among the old replicas (so several ranks fetching one hot
expert spread their reads). ``sends`` and ``receives`` order a rank's moves the
same way on both ends (by peer, then destination slot), which is the order one
all-to-all carries them in. ``StagedMove`` is one layer's move under way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd.engine.ep.placement import Placement
from pd.model.moe import MoeWeights


@dataclass(frozen=True)
class Move:
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


def align(old: Placement, new: Placement) -> Placement:
    """``new`` with each rank's slots reordered so that an expert the rank keeps stays in its old slot
    (a placement's slot order is free): a move then writes only the slots whose expert changes."""
    slots = []
    for held, wanted in zip(old.slots, new.slots):
        arriving = list(wanted)
        kept: list[int | None] = []
        for expert in held:
            if expert in arriving:
                arriving.remove(expert)
                kept.append(expert)
            else:
                kept.append(None)
        incoming = iter(arriving)
        slots.append(tuple(expert if expert is not None else next(incoming) for expert in kept))
    return Placement(tuple(slots), new.num_experts)


def plan_moves(old: Placement, new: Placement) -> list[Move]:
    """Every new slot's source, in (destination rank, slot) order."""
    if old.num_ranks != new.num_ranks or old.num_experts != new.num_experts:
        raise ValueError(f"placements of {old.num_ranks} ranks x {old.num_experts} experts and "
                         f"{new.num_ranks} x {new.num_experts} are not one layer's")
    moves = []
    for rank, held in enumerate(new.slots):
        own = old.slots[rank]
        for slot, expert in enumerate(held):
            if expert in own:
                moves.append(Move(expert, rank, own.index(expert), rank, slot))
                continue
            replicas = old.replicas(expert)
            if not replicas:
                raise ValueError(f"expert {expert} has no replica in the old placement")
            src_rank, src_slot = replicas[rank % len(replicas)]
            moves.append(Move(expert, src_rank, src_slot, rank, slot))
    return moves


def sends(moves: list[Move], rank: int, num_ranks: int) -> list[list[Move]]:
    """What ``rank`` sends each other rank, in the order that rank receives it."""
    return _by_peer(moves, num_ranks, lambda m: (m.src_rank, m.dst_rank), rank)


def receives(moves: list[Move], rank: int, num_ranks: int) -> list[list[Move]]:
    """What ``rank`` receives from each other rank, in the order that rank sends it."""
    return _by_peer(moves, num_ranks, lambda m: (m.dst_rank, m.src_rank), rank)


def _by_peer(moves: list[Move], num_ranks: int, ends, rank: int) -> list[list[Move]]:
    """``rank``'s moves between ranks grouped by the peer at their other end (``ends(move)``: this end's rank,
    the other's), each group by destination slot."""
    out: list[list[Move]] = [[] for _ in range(num_ranks)]
    for move in moves:
        here, peer = ends(move)
        if here == rank and peer != rank:
            out[peer].append(move)
    return [sorted(part, key=lambda m: m.dst_slot) for part in out]


@dataclass
class StagedMove:
    """A layer's move under way: its new placement, the moves between ranks, and the experts this rank has
    received so far (only those: the layer keeps running on its weights as they are until the last part)."""

    layer: int
    new: Placement
    moves: list[Move]
    cross: list[Move]  # between ranks, in (destination rank, slot) order: the same list on every rank
    rows: dict[tuple[int, int], int]  # (source rank, destination slot) of each move into this rank -> row
    w13: torch.Tensor  # [moves into this rank, 2I, H]
    w2: torch.Tensor
    done: int = 0  # of ``cross``, carried out
    seconds: float = 0.0

    @classmethod
    def start(cls, layer: int, old: Placement, new: Placement, weights: MoeWeights, rank: int) -> "StagedMove":
        moves = plan_moves(old, new)
        cross = [m for m in moves if m.src_rank != m.dst_rank]
        into = [m for m in cross if m.dst_rank == rank]
        shape = (len(into),)
        return cls(layer, new, moves, cross, {(m.src_rank, m.dst_slot): i for i, m in enumerate(into)},
                   weights.w13.new_empty(shape + weights.w13.shape[1:]), weights.w2.new_empty(shape + weights.w2.shape[1:]))

    def install(self, weights: MoeWeights, rank: int) -> None:
        """Write the new placement's experts into this rank's slots whose expert changes (every part done)."""
        local = [(m.dst_slot, m.src_slot) for m in self.moves
                 if m.src_rank == m.dst_rank == rank and m.src_slot != m.dst_slot]
        for weight, staged in ((weights.w13, self.w13), (weights.w2, self.w2)):
            copies = [(slot, weight[src].clone()) for slot, src in local]  # a kept expert's second replica
            for (_, slot), row in self.rows.items():
                weight[slot] = staged[row]
            for slot, value in copies:
                weight[slot] = value
