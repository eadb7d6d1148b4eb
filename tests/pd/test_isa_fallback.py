"""Hosts without AVX-512: bf16 layers multiply fp32 copies, and the C++ kernels run their AVX2 build.

An AVX-512 host runs the AVX2 path under ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN, and torch's bf16 check with it)
and ``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels, and the level ``pd_kernels.cpu`` builds for). Both are read
when a process starts, so the AVX2 path's tests run in a child pytest; on an AVX2-only host that child runs
the same tests on the host's own path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pd_kernels.cpu
from pd.model import linear
from pd.model.linear import choose_form, make_linear

AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# Set in the child: the path it is meant to run.
EXPECTED_ISA = "PD_TEST_EXPECTED_ISA"
ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")

# What the child runs: bf16 and fp16 models tracking fp32, the dense layers, and every C++ kernel's
# comparison with the reference.
AVX2_TESTS = ["tests/pd/test_isa_fallback.py", "tests/pd/test_linear.py", "tests/pd/test_model_loading.py",
              "tests/pd_kernels/test_cpu_attention.py", "tests/pd_kernels/test_cpu_dense_rows.py",
              "tests/pd_kernels/test_cpu_small_ops.py", "tests/pd_kernels/test_fp8_kv.py", "tests/pd/test_reference_match.py",
              "tests/pd_kernels/test_cpu_latent.py", "tests/pd_kernels/test_cpu_int8.py"]


@pytest.mark.parametrize("few_rows", [False, True])
@pytest.mark.parametrize("num_rows", [1, 8, 65])
def test_without_native_bf16_a_bf16_layer_multiplies_an_fp32_copy(monkeypatch, num_rows, few_rows):
    monkeypatch.setattr(linear, "bf16_supported", lambda: False)
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 40).bfloat16(), torch.randn(96).bfloat16(), torch.randn(num_rows, 40).bfloat16()
    layer = make_linear(weight, bias, "onednn", few_rows=few_rows)
    assert layer.packed and layer.output_dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    assert (layer.rows_kernel is not None) == few_rows
    got = layer(x)
    assert got.dtype == torch.bfloat16
    # The fp32 product of the bf16 values, rounded once to bf16.
    expected = (x.double() @ weight.double().t() + bias.double()).bfloat16()
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-2)
    assert choose_form("auto", CPU, torch.bfloat16, 256, 256).form == "onednn"  # fp32's choice


def test_each_isa_level_builds_with_its_own_flags_and_never_for_the_build_host():
    for level, flags in pd_kernels.cpu.ISA_FLAGS.items():
        built = pd_kernels.cpu.capability_flags(level)
        assert not any(flag.startswith("-march") for flag in built)
        assert set(flags) <= set(built)
    assert "-mavx512f" not in pd_kernels.cpu.capability_flags("AVX2")
    assert pd_kernels.cpu.capability_flags("DEFAULT") == []
    assert pd_kernels.cpu.isa() in pd_kernels.cpu.ISA_FLAGS


@pytest.mark.skipif(EXPECTED_ISA not in os.environ, reason="runs in the AVX2 child only")
def test_the_child_runs_the_avx2_path():
    assert pd_kernels.cpu.isa() == os.environ[EXPECTED_ISA]
    assert pd_kernels.cpu.build().__name__ == f"pd_cpu_kernels_{os.environ[EXPECTED_ISA].lower()}"
    assert not linear.bf16_supported()
    assert make_linear(torch.randn(8, 4).bfloat16(), None, "onednn").output_dtype == torch.bfloat16


@pytest.mark.integration  # a child pytest
@pytest.mark.skipif(EXPECTED_ISA in os.environ, reason="this is the child")
def test_the_avx2_path_passes_the_dense_layer_kernel_and_half_precision_tests():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AVX2"):
        pytest.skip(f"the host's vector ISA is {capability}: no AVX2 path to test")
    env = {**os.environ, **AVX2_ENV, EXPECTED_ISA: "AVX2"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AVX2_TESTS],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout
