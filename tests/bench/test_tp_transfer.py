"""bench.tp_transfer on one round: both directions land the right heads within the descriptor bound."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("transfer.nixl_api")

from bench import tp_transfer  # noqa: E402

pytestmark = pytest.mark.integration  # peer processes of different tensor-parallel splits


def test_each_direction_reads_its_heads_with_one_descriptor_per_block_and_source(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.tp_transfer", "--rounds", "1", "--warmup", "0"])
    tp_transfer.main()
    rows = {row["case"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"2to1", "1to2"}
    for row in rows.values():
        assert row["verified"] and row["ratio_vs_raw"] > 0
        assert row["descriptors"] == row["blocks"] * row["source_ranks"] <= row["descriptor_bound"]
