"""``bench.gpu_check``: its time budget, what it reads from a part's output, and its two phases run for real."""

from __future__ import annotations

import json

import pytest

from bench import gpu_check
from bench.gpu_check import BENCHMARKS, CHECKS, TOTAL_LIMIT_S, Part, Sink, pytest_counts, worst_case_s


def test_the_parts_fit_in_eight_minutes_and_each_has_a_unique_name():
    assert worst_case_s(CHECKS, BENCHMARKS) <= TOTAL_LIMIT_S <= 8 * 60  # the limit, model builds included
    names = [part.name for part in CHECKS + BENCHMARKS]
    assert len(names) == len(set(names))
    assert {"kernels", "bench_kernels", "gpu_engine", "gpu_engine_moe", "fp32_dense", "fp32_moe", "decode_roofline",
            "fp8_gemm"} <= set(names)


def test_pytest_counts_come_from_its_last_summary_line():
    log = "\n".join([
        "FAILED tests/x.py::test_a - 3 passed earlier",
        "10 failed, 89 passed, 15 skipped in 27.73s",
        "/opt/site-packages/pytest_benchmark/logger.py:44: PytestBenchmarkWarning: ...",
    ])
    assert pytest_counts(log) == {"failed": 10, "passed": 89, "skipped": 15}
    assert pytest_counts("===== 3 passed, 2 errors in 1.00s =====") == {"passed": 3, "error": 2}
    assert pytest_counts("no summary here") == {}


def test_a_long_log_keeps_its_head_and_tail():
    log = "h" * 100 + "m" * 1000 + "t" * 300
    kept = gpu_check.clipped(log, keep=400)
    assert kept.startswith("h" * 100) and kept.endswith("t" * 300) and "1000 characters elided" in kept


def _python(code: str) -> list[str]:
    return ["-c", code]


@pytest.mark.integration  # starts Python processes
def test_checks_run_side_by_side_and_a_part_past_its_limit_keeps_what_it_printed(tmp_path):
    line = json.dumps({"case": "x", "value": 1})
    checks = [
        Part("quick", _python(f"print({line!r})"), 20),
        Part("stuck", _python(f"import time; print({line!r}, flush=True); time.sleep(60)"), 2),
        Part("failing", _python("import sys; print('1 failed, 2 passed in 0.1s'); sys.exit(3)"), 20),
    ]
    sink = Sink(tmp_path)
    gpu_check.run_checks(checks, deadline=float("inf"), sink=sink)
    gpu_check.run_benchmarks([Part("bench", _python(f"print({line!r})"), 20)], deadline=float("inf"), sink=sink)
    gpu_check.run_benchmarks([Part("late", _python("pass"), 20)], deadline=0.0, sink=sink)
    sink.close()
    records = {record["part"]: record for record in sink.records}
    assert records["quick"]["rc"] == 0 and records["quick"]["results"] == [{"case": "x", "value": 1}]
    assert records["stuck"]["rc"] == "timeout" and records["stuck"]["results"] == [{"case": "x", "value": 1}]
    assert records["stuck"]["seconds"] < 20  # killed at its limit, beside the others
    assert records["failing"]["rc"] == 3 and records["failing"]["pytest"] == {"failed": 1, "passed": 2}
    assert records["bench"]["rc"] == 0 and records["late"]["rc"] == "not started"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.jsonl", "gpu_check.log"]
    lines = (tmp_path / "gpu_check.jsonl").read_text().splitlines()
    assert {json.loads(line)["part"] for line in lines} == set(records)
    assert "===== stuck: rc timeout" in (tmp_path / "gpu_check.log").read_text()


def test_the_engine_parts_pools_leave_room_for_hf_and_two_engines_on_an_80_gb_gpu():
    from bench import gpu_engine
    from bench.decode_roofline import weight_bytes
    from bench.random_models import SHAPES

    args = gpu_engine.parse_args([])  # the 8B shape at batch 32, HF's model and two engines on one GPU
    shape = SHAPES[args.model]
    weights = weight_bytes(shape, args.layers, batch=0) + 2 * shape.vocab_size * shape.hidden_size
    assert 3 * weights + 2 * gpu_engine.pool_bytes(args) < 0.8 * 80e9


def test_a_sync_is_placed_in_the_engines_code_not_in_torchs():
    import traceback

    from bench.step_syncs import ROOT, sync_site

    stack = [traceback.FrameSummary(str(ROOT / "bench" / "step_syncs.py"), 70, "count_syncs"),
             traceback.FrameSummary(str(ROOT / "pd" / "engine" / "block_pool.py"), 12, "grow"),
             traceback.FrameSummary(str(ROOT / "pd" / "engine" / "readback.py"), 40, "read"),
             traceback.FrameSummary("/site-packages/torch/__init__.py", 1270, "f")]
    assert sync_site("/site-packages/torch/__init__.py", 1270, stack) == "readback.py:40 via __init__.py:1270"
    assert sync_site("/site-packages/torch/__init__.py", 1270, stack[:1]) == "__init__.py:1270"
