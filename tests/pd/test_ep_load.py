"""Expert load over a sliding window: counts per layer, the window sliding bucket by bucket."""

from __future__ import annotations

import pytest
import torch

from pd.engine.ep.load import ExpertLoad
from pd.engine.ep.placement import balancedness, rebalance, static_placement


def test_counts_per_layer_and_expert_over_the_window():
    load = ExpertLoad(num_layers=2, num_experts=4, window_steps=4, num_buckets=2)
    load.add(0, torch.tensor([[0, 1], [0, 2]]))
    load.add(1, torch.tensor([[3, 3]]))  # a token routed twice to one expert counts twice
    load.end_step()
    assert load.counts().tolist() == [[2, 1, 1, 0], [0, 0, 0, 2]]
    load.add(0, torch.tensor([[1, 2]]))  # step 2 closes the first bucket
    load.end_step()
    assert load.counts()[0].tolist() == [2, 2, 2, 0]
    for _ in range(2):  # steps 3-4 close the second: the first (steps 1-2) is dropped whole, the window slides
        load.add(0, torch.tensor([[1, 2]]))
        load.end_step()
    assert load.counts()[0].tolist() == [0, 2, 2, 0] and load.num_steps == 4
    load.add(0, torch.tensor([[3, 3]]))
    load.end_step()
    assert load.counts()[0].tolist() == [0, 2, 2, 2] and load.counts()[1].tolist() == [0, 0, 0, 0]


def test_the_window_feeds_the_placement():
    load = ExpertLoad(num_layers=1, num_experts=8, window_steps=8, num_buckets=4)
    hot = torch.tensor([[0, 2]] * 8 + [[3, 4], [5, 6], [7, 1], [4, 6]] * 2)  # 0 and 2 take half the slots
    for _ in range(4):
        load.add(0, hot)
        load.end_step()
    tokens = [float(c) for c in load.counts()[0]]
    assert tokens[0] == tokens[2] == 4 * 8 and sum(tokens) == 4 * 2 * 16
    assert balancedness(static_placement(8, 2).rank_loads(tokens)) < 0.9
    assert balancedness(rebalance(tokens, 2, 2).rank_loads(tokens)) >= 0.9


@pytest.mark.parametrize("kwargs, message", [
    ({"num_layers": 0, "num_experts": 4}, "num_layers >= 1"),
    ({"num_layers": 1, "num_experts": 4, "window_steps": 10, "num_buckets": 4}, "positive multiple of num_buckets"),
])
def test_bad_windows_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertLoad(**kwargs)
