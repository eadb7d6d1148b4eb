"""``bench.step_syncs``' workloads run on the engine as it is: a device run finds them working, not rotted."""

from __future__ import annotations

import argparse

import pytest

from bench.step_syncs import count_syncs, make_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
            max_position_embeddings=2048)


@pytest.mark.slow  # two engines stepped in process, a 900-token prompt chunked beside 40 streams
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_the_mixed_workload_runs_every_kind_of_row_on_a_cpu(tmp_path, ahead):
    path = make_checkpoint(tmp_path, 1, TINY, device="cpu")
    line = count_syncs(path, "mixed", ahead, argparse.Namespace(batch=4, steps=6), device="cpu")
    assert line["workload"] == "mixed" and line["mode"] == ("async" if ahead else "sync") and line["steps"] == 6
    assert line["ok"] and line["sites"] == {} and line["gpu"] is None  # nothing is counted off a GPU
