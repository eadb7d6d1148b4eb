"""The AOT compile check, quick subset: every kernel compiles for sm_80 and sm_90 with no GPU here,
fits shared memory, spills no register, and the row-wise kernels stay under 128 registers.

Run as its users run it, in its own process: the kernel tests interpret Triton
(``TRITON_INTERPRET=1``), and interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # each test runs `python -m pd_kernels.aot` in a child process

# Copies and elementwise rows: under 128 registers a thread, so that 4 warps of them leave room for
# 4 blocks per SM (64K registers) and the loads in flight that a memory-bound kernel lives on.
ROW_KERNELS = ("store_kv", "rotary", "rms_norm", "silu_and_mul")
ROW_KERNEL_REGISTERS = 128


def _aot(*args: str) -> tuple[int, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pd_kernels.aot", "--quick", *args], capture_output=True, text=True,
                          env=env, timeout=600)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def test_every_kernel_compiles_for_a100_and_h100_without_spills():
    code, records = _aot("--jobs", "2")
    assert code == 0, [r for r in records if not r["ok"]]
    assert {r["kernel"] for r in records} == {"paged_attention", "merge_splits", "store_kv", "rotary", "rms_norm",
                                              "silu_and_mul", "moe_gate_up", "moe_down", "scaled_mm"}
    assert {r["arch"] for r in records} == {80, 90}
    assert {r["kv_dtype"] for r in records if r["kernel"] in ("paged_attention", "store_kv")} >= {
        None, "float8_e4m3fn"}
    assert not [r for r in records if r["spills"]], "a specialisation spills registers"
    heavy = [r for r in records if r["kernel"] in ROW_KERNELS and r["registers"] >= ROW_KERNEL_REGISTERS]
    assert not heavy, f"row-wise kernels at {ROW_KERNEL_REGISTERS}+ registers"
    for record in records:
        assert record["ok"] and record["registers"] > 0, record
        assert record["shared_bytes"] <= record["shared_limit_bytes"]
        assert {"dtype", "head_dim", "block_size", "spills"} <= set(record)


def test_shared_memory_over_the_limit_fails_the_check():
    code, records = _aot("--arch", "90", "--shared-limit", "1024", "--jobs", "2")
    assert code == 1
    assert any(not r["ok"] and r["kernel"] == "paged_attention" and r["shared_bytes"] > 1024 for r in records)
