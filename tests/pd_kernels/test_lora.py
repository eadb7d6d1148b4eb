"""The multi-LoRA delta: the reference against a per-row definition, the cpu backend (C++, and its AVX2 and
generic builds in child processes) and the Triton backend (interpreted here, compiled under ``make
gpu-check``) against the reference, a CUDA graph replay, and the launch checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pd_kernels
from pd_kernels import NO_LORA, reference
from pd_kernels.triton.lora import choose_num_splits, launch_lora_delta, lora_tiles
from tests.pd_kernels.conftest import DEVICE

# (row_slots, in_features, slice_starts, out_features, rank, num_slots): a decode batch whose rows of one
# slot are scattered, with rows without an adapter between them and slot 1 absent; q|k|v (3 slices) and
# gate|up (2); an unfused layer; sizes that are no multiple of a vector or a tile; a batch without
# adapters; an empty batch.
NO = NO_LORA
CASES = [
    ([0, NO, 2, 0, 2, NO, 3, 0], 48, (0, 32, 40), 48, 8, 4),
    ([1, 1, NO, 0, 1, 0, 1], 40, (0, 24), 48, 16, 2),
    ([2, NO, 0, 2, 2], 36, (0,), 20, 4, 3),
    ([3, 0, 5, NO, 1, 3, 3, 0, 5, 1, NO, 2], 70, (0, 40, 56), 72, 8, 6),
    ([NO, NO, NO], 32, (0, 16), 32, 8, 2),
    ([], 32, (0,), 16, 8, 2),
]
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3},
              torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}


def _name(value: object) -> str:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)


def _inputs(row_slots: list[int], in_features: int, slice_starts: tuple[int, ...], out_features: int, rank: int,
            num_slots: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device="cpu") * scale).to(DEVICE, dtype)

    rows = len(row_slots)
    return {"out": randn(rows, out_features), "x": randn(rows, in_features),
            "lora_a": randn(num_slots, len(slice_starts) * rank, in_features, scale=in_features ** -0.5),
            "lora_b": randn(num_slots, out_features, rank, scale=rank ** -0.5),
            "row_slots": torch.tensor(row_slots, dtype=torch.int32, device=DEVICE), "slice_starts": slice_starts}


def _per_row(out, x, lora_a, lora_b, row_slots, slice_starts) -> torch.Tensor:
    """The definition in float64, one row and one slice at a time: ``out`` with each adapter row's delta."""
    out, x, lora_a, lora_b = (t.cpu().double() for t in (out, x, lora_a, lora_b))
    rank, ends = lora_b.shape[2], (*slice_starts[1:], out.shape[1])
    expected = out.clone()
    for n, slot in enumerate(row_slots.tolist()):
        if slot == NO_LORA:
            continue
        for i, (start, end) in enumerate(zip(slice_starts, ends)):
            t = lora_a[slot, i * rank:(i + 1) * rank] @ x[n]  # [rank]
            expected[n, start:end] += lora_b[slot, start:end] @ t
    return expected


def _delta(args: dict, backend: str) -> torch.Tensor:
    out = args["out"].clone()
    pd_kernels.lora_delta(out, args["x"], args["lora_a"], args["lora_b"], args["row_slots"], args["slice_starts"],
                          backend=backend)
    return out


def _reference(args: dict) -> torch.Tensor:
    out = args["out"].clone()
    reference.lora_delta(out, args["x"], args["lora_a"], args["lora_b"], args["row_slots"], args["slice_starts"])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_per_row_definition(case, dtype):
    args = _inputs(*case, dtype=dtype)
    got = _reference(args)
    expected = _per_row(**args)
    assert got.dtype == dtype
    # One rounding to the dtype at the add, from sums in fp32: within a unit of the dtype's last place.
    torch.testing.assert_close(got.cpu().double(), expected.to(dtype).double(), **TOLERANCES[dtype])
    without = args["row_slots"].cpu() == NO_LORA
    assert torch.equal(got.cpu()[without], args["out"].cpu()[without])  # rows without an adapter untouched


BACKENDS = ["cpu", "triton"] if DEVICE == "cpu" else ["triton"]
# The Triton interpreter computes in numpy, which has no bf16: Triton's bf16 runs compiled (make gpu-check).
BACKEND_DTYPES = [(backend, dtype) for backend in BACKENDS
                  for dtype in (torch.float32, torch.float16, torch.bfloat16)
                  if not (backend == "triton" and dtype == torch.bfloat16 and DEVICE == "cpu")]


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES, ids=_name)
@pytest.mark.parametrize("case", CASES)
def test_backend_equals_the_reference(backend, dtype, case):
    args = _inputs(*case, dtype=dtype)
    torch.testing.assert_close(_delta(args, backend), _reference(args), **TOLERANCES[dtype])


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_the_shrink_is_not_rounded_to_the_dtype(backend):
    """t stays fp32 between the two products: an fp16 t would lose the 1e-4 of 1 + 1e-4."""
    x = torch.zeros(1, 16, dtype=torch.float16, device=DEVICE)
    x[0, :2] = torch.tensor([1.0, 1e-4])
    lora_a = torch.zeros(1, 1, 16, dtype=torch.float16, device=DEVICE)
    lora_a[0, 0, :2] = 1.0
    lora_b = torch.full((1, 1, 1), 1000.0, dtype=torch.float16, device=DEVICE)
    out = torch.full((1, 1), -1000.0, dtype=torch.float16, device=DEVICE)
    pd_kernels.lora_delta(out, x, lora_a, lora_b, torch.zeros(1, dtype=torch.int32, device=DEVICE), (0,),
                          backend=backend)
    assert out.item() == pytest.approx(0.1, rel=1e-2)  # 1000 * (1 + 1e-4) - 1000, rounded once


# Shapes the C++ kernel splits across threads and vector tails: a decode batch at SmolLM2-135M's q|k|v
# (576 -> 576 + 192 + 192) over 4 of 8 slots, rank 16; a prefill-sized batch of one slot, rank 64.
CPU_SHAPES = [
    ([(n * 5) % 4 if n % 7 else NO for n in range(32)], 576, (0, 576, 768), 960, 16, 8),
    ([3] * 300, 200, (0, 150), 230, 64, 4),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend's paths")
@pytest.mark.parametrize("case", CPU_SHAPES, ids=["decode-qkv", "prefill-gate-up"])
def test_cpu_path_at_model_shapes_equals_the_reference(case):
    args = _inputs(*case)
    torch.testing.assert_close(_delta(args, "cpu"), _reference(args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_of_out_and_x(backend):
    """out and x as column ranges of wider rows (a fused projection's output, a shared buffer)."""
    args = _inputs([1, NO, 0, 1, 1], 40, (0, 16), 32, 8, 2)
    wide_out = torch.randn(5, 48, device=DEVICE)
    wide_x = torch.randn(5, 56, device=DEVICE)
    wide_out[:, 8:40] = args["out"]
    wide_x[:, 16:] = args["x"]
    before = wide_out.clone()
    pd_kernels.lora_delta(wide_out[:, 8:40], wide_x[:, 16:], args["lora_a"], args["lora_b"], args["row_slots"],
                          args["slice_starts"], backend=backend)
    torch.testing.assert_close(wide_out[:, 8:40], _reference(args), rtol=1e-5, atol=1e-5)
    assert torch.equal(wide_out[:, :8], before[:, :8]) and torch.equal(wide_out[:, 40:], before[:, 40:])


@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_split_k_sums_its_partials(num_splits):
    """The shrink over ``in_features`` in splits, each its own fp32 partial, summed by the expand."""
    args = _inputs(*CASES[3])
    out = args.pop("out").clone()
    expected = _reference({**args, "out": out})
    launch_lora_delta(out, **args, tiles=lora_tiles(4), num_splits=num_splits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_rows", [0, 1, 32, 4096])
def test_the_shrinks_splits_on_a_gpu_for_any_row_count(num_rows):
    # On a GPU (132 SMs) a batch of no rows once divided by its zero row blocks.
    for element_size in (2, 4):
        splits = choose_num_splits(num_rows, 4096, 48, lora_tiles(element_size), sm_count=132)
        assert splits >= 1 and (num_rows > 0 or splits == 1)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_the_triton_lora_replays_in_a_cuda_graph():
    """Both launches capture (no op reads the device back) and replay with new rows and new slots."""
    args = _inputs(*CASES[0], dtype=torch.bfloat16)
    out = args.pop("out")
    pd_kernels.lora_delta(out.clone(), **args, backend="triton")  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pd_kernels.lora_delta(out, **args, backend="triton")
    fresh = _inputs([3, 3, NO, 1, 0, 2, NO, 1], 48, (0, 32, 40), 48, 8, 4, dtype=torch.bfloat16, seed=7)
    for name in ("out", "x", "row_slots"):
        (out if name == "out" else args[name]).copy_(fresh[name])
    graph.replay()
    torch.testing.assert_close(out, _reference({**args, "out": fresh["out"]}), **TOLERANCES[torch.bfloat16])


def _bad(**changes) -> dict:
    args = _inputs([0, 1, NO, 0], 32, (0, 16), 32, 8, 2)
    return {**args, **changes}


BAD_ARGS = [
    (_bad(out=torch.zeros(4)), "out: expected 2 dimensions"),
    (_bad(out=torch.zeros(4, 32, dtype=torch.float64)), "out: dtype torch.float64 is not supported"),
    (_bad(x=torch.zeros(4, 32, dtype=torch.float16)), "x: expected dtype torch.float32"),
    (_bad(lora_b=torch.zeros(2, 32, 8, dtype=torch.bfloat16)), "lora_b: expected dtype torch.float32"),
    (_bad(row_slots=torch.zeros(4, dtype=torch.int64)), "row_slots: expected dtype torch.int32"),
    (_bad(x=torch.zeros(3, 32)), r"x: x \(3, 32\) has 3 rows, out \(4, 32\) has 4"),
    (_bad(row_slots=torch.zeros(5, dtype=torch.int32)), r"row_slots: expected 4 entries \(one per row of out"),
    (_bad(lora_b=torch.zeros(2, 24, 8)), r"lora_b: expected \[num_slots, out_features = 32, rank >= 1\]"),
    (_bad(lora_a=torch.zeros(2, 24, 32)), r"lora_a: expected \[num_slots, num_slices \* rank, in_features\] = "
                                          r"\(2, 16, 32\)"),
    (_bad(lora_a=torch.zeros(3, 16, 32)), r"lora_a: .* = \(2, 16, 32\)"),
    (_bad(lora_b=torch.zeros(2, 32, 0), lora_a=torch.zeros(2, 0, 32)),
     r"lora_b: .* rank >= 1\], got \(2, 32, 0\)"),
    (_bad(slice_starts=()), "slice_starts: must be a non-empty tuple of ints"),
    (_bad(slice_starts=(0, 16.0)), "slice_starts: must be a non-empty tuple of ints"),
    (_bad(slice_starts=(8, 16)), "slice_starts: the first slice starts at column 0"),
    (_bad(slice_starts=(0, 0)), "slice_starts: must ascend strictly below out_features 32"),
    (_bad(slice_starts=(0, 32)), "slice_starts: must ascend strictly below out_features 32"),
    (_bad(x=torch.zeros(32, 4).t()), "x: the last axis must be contiguous"),
    (_bad(out=torch.zeros(32, 4).t()), "out: the last axis must be contiguous"),
    (_bad(lora_a=torch.zeros(2, 32, 16).transpose(1, 2)), "lora_a: must be contiguous"),
    (_bad(lora_b=torch.zeros(2, 8, 32).transpose(1, 2)), "lora_b: must be contiguous"),
    (_bad(row_slots=torch.zeros(8, dtype=torch.int32)[::2]), "row_slots: must be contiguous"),
    (_bad(lora_a=torch.zeros(2, 16, 32, device="meta")), "lora_a: is on meta, out is on"),
    *([(_bad(row_slots=torch.tensor([0, 2, NO, 0], dtype=torch.int32)), r"row_slots: .* in \[0, 2\) or NO_LORA"),
       (_bad(row_slots=torch.tensor([0, -2, NO, 0], dtype=torch.int32)), r"got \[-2, 0\]")]
      if DEVICE == "cpu" else []),  # values are checked on CPU only: on a GPU the check would sync
]


@pytest.mark.parametrize("args, message", BAD_ARGS, ids=[f"{message.split(':')[0]}-{i}"
                                                         for i, (_, message) in enumerate(BAD_ARGS)])
def test_bad_arguments_fail_naming_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        pd_kernels.lora_delta(args.pop("out"), **args, backend="torch")


@pytest.mark.skipif(DEVICE != "cpu", reason="the device check's wiring, checked where there is no GPU")
def test_the_device_checks_lora_part_parses_its_arguments_and_skips_without_cuda(capsys):
    """``make gpu-check``'s lora part (``bench.gpu_check``) runs ``bench.lora_kernel`` with arguments it takes;
    without CUDA it says so in one line."""
    from bench import gpu_check, lora_kernel

    part = next(part for part in gpu_check.BENCHMARKS if part.name == "lora_kernel")
    assert part.args[:2] == ["-m", "bench.lora_kernel"]
    lora_kernel.main(part.args[2:])
    assert json.loads(capsys.readouterr().out) == {"case": "skipped", "reason": "no CUDA device"}


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend's benchmark")
def test_the_cpu_benchmark_names_its_host_and_times_every_layer(capsys):
    from bench import lora_kernel

    lora_kernel.main(["--repeats", "1", "--threads", str(torch.get_num_threads())])  # the session's threads kept
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["case"] == "host" and {"cpu", "isa", "cpu_flags", "threads"} <= set(lines[0])
    timed = lines[1:]
    assert {(line["layer"], line["batch"]) for line in timed} == {
        (layer.name, batch) for layer in lora_kernel.SMOLLM2_LAYERS for batch in ("4_adapters", "no_adapter")}
    assert all(line["cpu_over_linear"] > 0 and line["max_abs_diff"] < 1e-5 for line in timed)
    assert {line["adapters"] for line in timed} == {4, 0}


# The C++ kernel's lower ISA levels, each in a child pytest: ATEN_CPU_CAPABILITY is read at start. On an
# AVX-512 host that is the AVX2 build (8 lanes, 2 rows a shrink group) and the generic one (ATen's scalar
# Vectorized); a lower host runs what it has.
ISA_CHILD = "PD_TEST_LORA_ISA"
LOWER_LEVELS = {"AVX2": "avx2", "DEFAULT": "default"}


@pytest.mark.integration  # a child pytest
@pytest.mark.skipif(DEVICE != "cpu" or ISA_CHILD in os.environ, reason="the parent, on CPU")
@pytest.mark.parametrize("level", LOWER_LEVELS)
def test_the_lower_isa_builds_pass_the_cpu_tests(level):
    if level == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip("no AVX2 path on this host")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": LOWER_LEVELS[level], ISA_CHILD: level}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                            "-k", "cpu and not lower_isa or child_runs"], cwd=Path(__file__).resolve().parents[2],
                           env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout.splitlines()[-1], child.stdout[-2000:]


@pytest.mark.skipif(ISA_CHILD not in os.environ, reason="runs in a lower-ISA child only")
def test_the_child_runs_its_isa_build():
    import pd_kernels.cpu

    assert pd_kernels.cpu.isa() == os.environ[ISA_CHILD]
    assert pd_kernels.cpu.build().__name__ == f"pd_cpu_kernels_{os.environ[ISA_CHILD].lower()}"
