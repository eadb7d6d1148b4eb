"""Where each expert lives under expert parallelism: DeepSeek's EPLB placement, rewritten here.

Given each MoE layer's measured load per (logical) expert, place
``num_physical = num_experts + num_redundant`` expert replicas on ``num_ranks``
ranks, ``num_physical / num_ranks`` slots each:

1. **Replicate.** Every expert gets one replica; each redundant slot goes, one
   at a time, to the expert whose load per replica is then the largest.
2. **Pack.** Replicas (each carrying its expert's load over its replica count)
   go to ranks heaviest first, each to the least-loaded rank with a free slot
   (greedy balanced packing), and never to a rank that already holds a
   replica of the same expert while another has room (ours: two replicas on
   one rank would balance nothing).

``hierarchical`` placement first packs groups of experts (``num_groups``, the
model's expert groups, e.g. DeepSeek-V3's) onto nodes, so that a token's
experts stay on few nodes and the all-to-all crosses fewer links, then
replicates and packs within each node. ``global`` placement treats the ranks as
one node. Ties break by the lower expert or rank index, so a placement is a
function of the loads alone (every rank computes the same one).

The algorithm is DeepSeek's (github.com/deepseek-ai/EPLB, MIT); this is our
own code of it, on plain Python lists (tens to hundreds of experts per layer).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One layer's placement: ``slots[r]`` are rank ``r``'s physical experts, as logical expert ids."""

    slots: tuple[tuple[int, ...], ...]
    num_experts: int

    @property
    def num_ranks(self) -> int:
        return len(self.slots)

    def replicas(self, expert: int) -> list[tuple[int, int]]:
        """``(rank, slot)`` of each replica of ``expert``, in rank order."""
        return [(rank, slot) for rank, held in enumerate(self.slots) for slot, e in enumerate(held) if e == expert]

    def replica_counts(self) -> list[int]:
        counts = [0] * self.num_experts
        for held in self.slots:
            for expert in held:
                counts[expert] += 1
        return counts

    def rank_loads(self, load: list[float]) -> list[float]:
        """Each rank's share of ``load`` (per logical expert), a replica taking an equal part of its expert's."""
        counts = self.replica_counts()
        return [sum(load[e] / counts[e] for e in held) for held in self.slots]


def balancedness(rank_loads: list[float]) -> float:
    """Mean over max load per rank: 1.0 when balanced (and for no load at all)."""
    peak = max(rank_loads, default=0.0)
    return 1.0 if peak <= 0 else sum(rank_loads) / len(rank_loads) / peak


def static_placement(num_experts: int, num_ranks: int) -> Placement:
    """Experts in order, ``num_experts / num_ranks`` contiguous ones a rank, no replicas (the placement
    before any statistics)."""
    check_placement_args(num_experts, num_ranks, 0, 1, 1)
    per = num_experts // num_ranks
    return Placement(tuple(tuple(range(r * per, (r + 1) * per)) for r in range(num_ranks)), num_experts)


def check_placement_args(num_experts: int, num_ranks: int, num_redundant: int, num_groups: int,
                         num_nodes: int) -> None:
    """Raise ``ValueError`` naming what cannot be placed."""
    if num_experts < 1 or num_ranks < 1 or num_redundant < 0 or num_groups < 1 or num_nodes < 1:
        raise ValueError(f"need num_experts >= 1, num_ranks >= 1, num_redundant >= 0, num_groups >= 1 and "
                         f"num_nodes >= 1; got {num_experts}, {num_ranks}, {num_redundant}, {num_groups}, {num_nodes}")
    physical = num_experts + num_redundant
    if physical % num_ranks:
        raise ValueError(f"{num_experts} experts plus {num_redundant} redundant ones ({physical}) do not divide "
                         f"over {num_ranks} expert-parallel ranks")
    if num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} expert-parallel ranks do not divide over {num_nodes} nodes")
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not divide into {num_groups} expert groups")
    if num_groups % num_nodes:
        raise ValueError(f"{num_groups} expert groups do not divide over {num_nodes} nodes (hierarchical placement)")
    if num_redundant % num_nodes:
        raise ValueError(f"{num_redundant} redundant experts do not divide over {num_nodes} nodes")


def replicate(load: list[float], num_replicas: int) -> list[int]:
    """Replica counts per expert, ``num_replicas`` in all: one each, then each extra one to the expert with
    the largest load per replica (the lower index on a tie)."""
    if num_replicas < len(load):
        raise ValueError(f"{num_replicas} replicas cannot hold {len(load)} experts")
    counts = [1] * len(load)
    heap = [(-w, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(num_replicas - len(load)):
        _, expert = heapq.heappop(heap)
        counts[expert] += 1
        heapq.heappush(heap, (-load[expert] / counts[expert], expert))
    return counts


def pack(weights: list[float], num_bins: int, keys: list[int] | None = None) -> list[list[int]]:
    """Items (by index) into ``num_bins`` bins of ``len(weights) / num_bins`` items each: heaviest first, each
    into the lightest bin with room (the lower bin on a tie). Returns each bin's items.

    With ``keys``, an item avoids a bin that already holds an item of its key while another bin has room:
    two replicas of one expert on one rank would share that rank's load and balance nothing.
    """
    per = len(weights) // num_bins
    if per * num_bins != len(weights):
        raise ValueError(f"{len(weights)} items do not divide into {num_bins} equal bins")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    held: list[set[int]] = [set() for _ in range(num_bins)]
    totals = [0.0] * num_bins
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        key = None if keys is None else keys[item]
        target = min((b for b in range(num_bins) if len(bins[b]) < per),
                     key=lambda b: (key in held[b], totals[b], b))
        bins[target].append(item)
        held[target].add(key)
        totals[target] += weights[item]
    return bins


def _place_on_ranks(experts: list[int], load: list[float], num_slots: int, num_ranks: int) -> list[list[int]]:
    """``experts`` (logical ids) replicated to ``num_slots`` and packed onto ``num_ranks`` ranks."""
    counts = dict(zip(experts, replicate([load[e] for e in experts], num_slots)))
    replicas = [e for e in experts for _ in range(counts[e])]
    weights = [load[e] / counts[e] for e in replicas]
    return [sorted(replicas[i] for i in held) for held in pack(weights, num_ranks, keys=replicas)]


def rebalance(load: list[float], num_ranks: int, num_redundant: int = 0, *, num_groups: int = 1,
              num_nodes: int = 1) -> Placement:
    """One layer's placement for ``load`` (per logical expert, e.g. tokens over a window).

    With ``num_nodes > 1`` it is hierarchical: the ``num_groups`` expert groups are packed onto nodes by
    their loads, then each node replicates its experts into its share of the redundant slots and packs
    them onto its ranks. With one node it is global.
    """
    num_experts = len(load)
    check_placement_args(num_experts, num_ranks, num_redundant, num_groups, num_nodes)
    if any(w < 0 for w in load):
        raise ValueError("expert loads must be >= 0")
    group_size = num_experts // num_groups
    group_loads = [sum(load[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = (num_experts + num_redundant) // num_nodes
    slots: list[tuple[int, ...]] = []
    for groups in pack(group_loads, num_nodes):
        experts = sorted(e for g in groups for e in range(g * group_size, (g + 1) * group_size))
        slots += [tuple(held) for held in _place_on_ranks(experts, load, slots_per_node, ranks_per_node)]
    return Placement(tuple(slots), num_experts)
