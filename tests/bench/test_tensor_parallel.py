"""bench.tensor_parallel on a tiny run: one line per size, weights halved per rank, outputs as TP=1's."""

from __future__ import annotations

import json
import sys

import pytest

from bench import tensor_parallel

pytestmark = pytest.mark.integration  # tensor-parallel engines start a worker process per rank


def test_each_size_reports_its_ranks_weights_and_its_speed_against_one_rank(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.tensor_parallel", "--repeats", "1", "--requests", "2",
                                      "--max-tokens", "4", "--prompt-len", "16", "--sizes", "1,2", "--threads", "2"])
    tensor_parallel.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    one, two = lines
    assert one["over_tp1"] == 1.0 and len(two["weight_bytes_per_rank"]) == 2
    assert 0.49 < two["max_rank_over_tp1"] < 0.52
    assert two["outputs_equal_tp1"] == two["num_outputs"] == 2
