"""EPLB placement: exact outputs on small load tables, balance on a skewed router, and the refusals."""

from __future__ import annotations

import pytest

from pd.engine.ep.placement import (
    balancedness,
    pack,
    rebalance,
    replicate,
    static_placement,
)

# 8 experts, 2 of them taking half the tokens (the skewed router).
SKEWED = [25.0, 1.0, 25.0, 9.0, 10.0, 8.0, 14.0, 8.0]


def test_replication_gives_each_extra_replica_to_the_largest_load_per_replica():
    assert replicate([10.0, 1.0, 6.0], 3) == [1, 1, 1]
    assert replicate([10.0, 1.0, 6.0], 5) == [2, 1, 2]  # 10 -> 5 per replica, then 6 is the largest
    assert replicate([10.0, 1.0, 6.0], 6) == [3, 1, 2]
    assert replicate([4.0, 4.0], 3) == [2, 1]  # a tie goes to the lower index
    with pytest.raises(ValueError, match="2 replicas cannot hold 3 experts"):
        replicate([1.0, 2.0, 3.0], 2)


def test_packing_puts_the_heaviest_first_into_the_lightest_bin_with_room():
    assert pack([5.0, 1.0, 4.0, 2.0], 2) == [[0, 1], [2, 3]]
    assert pack([3.0, 3.0, 3.0, 3.0], 2) == [[0, 2], [1, 3]]
    # Two replicas of expert 7 (keys) never share a bin while the other has room: without keys they would.
    assert pack([6.0, 6.0, 1.0, 2.0], 2) == [[0, 3], [1, 2]]
    assert pack([5.0, 2.0, 2.0, 1.0], 2) == [[0, 3], [1, 2]]
    assert pack([5.0, 2.0, 2.0, 1.0], 2, keys=[1, 7, 7, 2]) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="5 items do not divide into 2 equal bins"):
        pack([1.0] * 5, 2)


def test_global_placement_of_the_skewed_router_is_exact_and_balanced():
    static = static_placement(8, 2)
    assert static.slots == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert round(balancedness(static.rank_loads(SKEWED)), 3) == 0.833  # 60 of 100 on rank 0
    placed = rebalance(SKEWED, 2, 2)
    assert placed.slots == ((0, 1, 2, 5, 6), (0, 2, 3, 4, 7))
    assert placed.replica_counts() == [2, 1, 2, 1, 1, 1, 1, 1]
    assert placed.rank_loads(SKEWED) == [48.0, 52.0]
    assert balancedness(placed.rank_loads(SKEWED)) >= 0.9
    assert placed.replicas(0) == [(0, 0), (1, 0)]


def test_hierarchical_placement_keeps_each_group_on_one_node():
    load = [9.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # groups of 2: (0,1) (2,3) (4,5) (6,7)
    placed = rebalance(load, 4, 4, num_groups=4, num_nodes=2)
    assert placed.num_ranks == 4 and sum(len(s) for s in placed.slots) == 12
    nodes = [set(placed.slots[0] + placed.slots[1]), set(placed.slots[2] + placed.slots[3])]
    for group in ((0, 1), (2, 3), (4, 5), (6, 7)):
        assert any(set(group) <= node for node in nodes), (group, nodes)
    assert placed.replica_counts()[0] >= 2  # the hot expert is replicated within its node
    assert rebalance(load, 4, 4, num_groups=4, num_nodes=2) == placed  # a function of the loads alone


@pytest.mark.parametrize("args, message", [
    (([1.0] * 8, 3, 0), "8 experts plus 0 redundant ones \\(8\\) do not divide over 3 expert-parallel ranks"),
    (([1.0] * 8, 2, 1), "plus 1 redundant ones \\(9\\)"),
    (([1.0] * 8, 4, 0, 3, 2), "8 experts do not divide into 3 expert groups"),
    (([1.0] * 8, 4, 0, 2, 4), "2 expert groups do not divide over 4 nodes"),
    (([1.0] * 8, 4, 0, 4, 3), "4 expert-parallel ranks do not divide over 3 nodes"),
    (([1.0] * 7 + [-1.0], 2, 0), "loads must be >= 0"),
])
def test_layouts_that_cannot_be_placed_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance(*args[:3], **dict(zip(("num_groups", "num_nodes"), args[3:])))


def test_balancedness_of_nothing_and_of_a_hot_rank():
    assert balancedness([0.0, 0.0]) == 1.0
    assert balancedness([3.0, 1.0]) == 0.5 + 1 / 6
