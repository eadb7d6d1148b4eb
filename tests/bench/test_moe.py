"""``bench.moe``: ours, HF's eager experts, the dense peer and the memory bound, on tiny shapes."""

from __future__ import annotations

import json

import pytest

from bench import moe


def test_each_config_and_token_count_reports_the_ratios_and_the_host(capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(moe, "CYCLE_BYTES", 1024**2)  # tiny weights: a few copies, not 96 MiB of them
    monkeypatch.setattr(moe, "STREAM_BYTES", 16 * 1024**2)
    moe.main(["--tokens", "2", "9", "--hidden", "64", "--inter", "32", "--threads", "1", "--configs", "4x2",
              "--repeats", "2"])
    report = json.loads(capsys.readouterr().out)
    assert report["case"] == "fused_moe" and report["cpu"] and report["isa"] in ("AVX512", "AVX2", "DEFAULT")
    assert isinstance(report["cpu_flags"], list) and report["stream_gb_s"] > 0 and report["dtype"] == "float32"
    assert [(r["experts"], r["top_k"], r["tokens"]) for r in report["results"]] == [(4, 2, 2), (4, 2, 9)]
    for line in report["results"]:
        assert 1 <= line["experts_touched"] <= 4
        for field in ("ours_ms", "hf_ms", "dense_ms", "bound_ms", "hf_over_ours", "dense_over_ours",
                      "bound_over_ours", "dense_over_bound"):
            assert line[field] > 0, field
        assert line["max_abs_error"] < 1e-4  # ours against the reference on the benchmark's own inputs


def test_configs_parse_as_experts_by_top_k():
    assert moe._config("16x4") == (16, 4)
