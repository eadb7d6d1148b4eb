"""FP8 KV pages: quantization at the range limits, the C++ store bit for bit against torch's cast, and
the attention kernels against the reference over FP8 pools poisoned with NaN where nothing may read."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import pd_kernels
from pd_kernels import fp8, reference
from tests.pd_kernels.paged_batch import LAYER, make_batch

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
ids = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@pytest.mark.parametrize("dtype", FORMATS, ids=ids.get)
def test_quantize_saturates_never_makes_nan_and_keeps_nan(dtype):
    top = fp8.fp8_max(dtype)
    x = torch.tensor([0.0, -0.0, 1.0, top, -top, top * 1.01, -top * 7, 1e30, -1e30, float("inf"), float("-inf"),
                      1e-30, float("nan")])
    stored = fp8.quantize(x, 1.0, dtype).float()
    assert stored[:-1].isfinite().all()
    assert stored[3:9].abs().eq(top).all() and stored[9:11].abs().eq(top).all()
    assert stored[-1].isnan()
    # The scale divides on store and multiplies on read: 1000 with scale 4 is stored as 250.
    assert fp8.dequantize(fp8.quantize(torch.tensor([1000.0]), 4.0, dtype), 4.0).item() == pytest.approx(1000, rel=0.07)
    assert {e.item() for e in fp8.quantize(torch.tensor([top * 10]), 2.0, dtype).float()} == {top}


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Every code's value, the midpoints between neighbours (ties), just off them, and a wide random spread."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    spread = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-12, 6, 20000)
    near = torch.cat([mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(float("-inf")))])
    return torch.cat([finite, mids, near, spread, -spread, torch.tensor([float("nan"), 1e9, -1e9])])


@pytest.mark.parametrize("rows", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype", FORMATS, ids=ids.get)
def test_cpu_store_rounds_exactly_as_the_reference(dtype, scale, rows):
    values = _hard_values(dtype).to(rows)
    head_dim = 64
    values = torch.cat([values, torch.zeros(-values.numel() % head_dim, dtype=rows)]).view(-1, 1, head_dim)
    tokens = values.shape[0]
    caches = {}
    for backend in ("torch", "cpu"):
        k = torch.zeros(tokens, 1, 1, head_dim, dtype=dtype)
        v = torch.zeros_like(k)
        slots = torch.arange(tokens)
        pd_kernels.store_kv(values, -values, k, v, slots, k_scale=scale, v_scale=scale * 2, backend=backend)
        caches[backend] = (k.view(torch.uint8), v.view(torch.uint8))
    assert torch.equal(caches["cpu"][0], caches["torch"][0])
    assert torch.equal(caches["cpu"][1], caches["torch"][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_store_copies_half_precision_rows_as_the_reference(dtype):
    paged = make_batch([(40, 40), (1, 17)], 4, 2, 64, 16, dtype)
    key, value = torch.randn(41, 2, 64).to(dtype), torch.randn(41, 2, 64).to(dtype)
    slots = torch.randperm(paged.pool.shape[0] * 16)[:41]  # distinct: no two rows race for a slot
    slots[5] = -1
    pools = {}
    for backend in ("torch", "cpu"):
        pool = paged.pool.clone()
        _, k, v, *_ = paged.args(pool)
        pd_kernels.store_kv(key, value, k, v, slots, backend=backend)
        pools[backend] = pool
    assert torch.equal(pools["cpu"], pools["torch"])


DECODE = [(1, 523), (1, 37), (1, 700), (1, 1)]
MIXED = [(1, 300), (5, 18), (129, 463), (1, 16), (40, 1100)]


@pytest.mark.parametrize("dtype", FORMATS, ids=ids.get)
@pytest.mark.parametrize("case", [((8, 2), 64, 16, DECODE, None, None), ((9, 3), 64, 32, MIXED, None, None),
                                  ((8, 2), 128, 16, MIXED, 64, 30.0), ((4, 4), 32, 16, MIXED, None, None),
                                  ((6, 2), 48, 16, DECODE, None, None)],
                         ids=lambda c: f"h{c[0][0]}/{c[0][1]}-d{c[1]}-w{c[4]}")
def test_cpu_attention_reads_fp8_pages_as_the_reference(case, dtype):
    (heads, kv_heads), head_dim, block_size, batch, window, softcap = case
    paged = make_batch(batch, heads, kv_heads, head_dim, block_size, torch.float32, kv_dtype=dtype)
    scales = {"k_scale": 0.05, "v_scale": 3.0}
    expected = reference.unified_attention(*paged.args(), head_dim**-0.5, sliding_window=window, softcap=softcap,
                                           **scales)
    actual = pd_kernels.unified_attention(*paged.args(paged.poisoned_pool()), head_dim**-0.5, sliding_window=window,
                                       softcap=softcap, backend="cpu", **scales)
    assert not actual.isnan().any()
    assert (actual - expected).abs().max().item() <= 1e-4 * scales["v_scale"] * 4


@pytest.mark.parametrize("dtype", FORMATS, ids=ids.get)
def test_every_code_reads_as_torch_reads_it(dtype):
    # Two decodes of one key each: the output is that key's value row, so each code's value, exactly.
    codes = torch.arange(256, dtype=torch.uint8)
    nan = codes.view(dtype).float().isnan()
    codes[nan] = 0
    paged = make_batch([(1, 1), (1, 1)], 2, 1, 128, 16, torch.float32, kv_dtype=dtype)
    first = paged.block_table[:, 0].long()
    paged.pool.view(torch.uint8)[first, 0, LAYER, 1, 0] = codes.view(2, 128)
    out = pd_kernels.unified_attention(*paged.args(), 0.1, v_scale=0.5, backend="cpu")
    expected = codes.view(dtype).float().view(2, 128) * 0.5
    assert torch.equal(out[:, 0], expected) and torch.equal(out[:, 1], expected)


def test_a_nan_code_reaches_its_rows_output():
    paged = make_batch([(1, 20), (1, 20)], 4, 1, 64, 16, torch.float32, kv_dtype=torch.float8_e4m3fn)
    paged.pool.view(torch.uint8)[paged.block_table[0, 0].long(), 0, LAYER, 0, 3, 5] = 0x7F
    out = pd_kernels.unified_attention(*paged.args(), 0.1, backend="cpu")
    assert out[0].isnan().all() and not out[1].isnan().any()


def test_bad_scales_and_pools_are_refused_by_name():
    paged = make_batch(DECODE, 8, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="k_scale: KV scales apply to FP8 pages only"):
        pd_kernels.unified_attention(*paged.args(), 0.1, k_scale=2.0)
    fp8_batch = make_batch(DECODE, 8, 2, 64, 16, torch.float32, kv_dtype=torch.float8_e4m3fn)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="v_scale: a KV scale must be a finite number > 0"):
            pd_kernels.unified_attention(*fp8_batch.args(), 0.1, v_scale=bad)
    int8 = make_batch(DECODE, 8, 2, 64, 16, torch.float32)
    q, k, v, *rest = int8.args()
    with pytest.raises(ValueError, match="k_cache: dtype torch.int8 is neither"):
        pd_kernels.unified_attention(q, k.to(torch.int8), v.to(torch.int8), *rest, 0.1)


_SCALAR_PROGRAM = r"""
#include "kv_fp8.h"
#include <cstdio>
int main() {
  for (int b = 0; b < 256; ++b) {
    const uint8_t code = static_cast<uint8_t>(b);
    pd_cpu::E4m3 e4[8]; pd_cpu::E5m2 e5[8]; float r4[8], r5[8];
    for (auto& e : e4) e.bits = code;
    for (auto& e : e5) e.bits = code;
    pd_cpu::load_row(e4, r4, 8);
    pd_cpu::load_row(e5, r5, 8);
    std::printf("%a %a\n", r4[0] * pd_cpu::kRowFactor<pd_cpu::E4m3>, r5[0] * pd_cpu::kRowFactor<pd_cpu::E5m2>);
  }
}
"""


def test_the_build_without_f16c_reads_every_code_as_torch(tmp_path):
    # The DEFAULT build (no vector flags: another architecture, or an x86 host without F16C) converts
    # in plain C++; compiled here on its own, without -mf16c, to check every code.
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on this host")
    source = tmp_path / "codes.cpp"
    source.write_text(_SCALAR_PROGRAM)
    binary = tmp_path / "codes"
    include = Path(pd_kernels.__file__).parent / "cpu"
    subprocess.run([compiler, "-O1", "-std=c++17", "-mno-f16c", f"-I{include}", str(source), "-o", str(binary)],
                   check=True)
    lines = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split("\n")[:256]
    codes = torch.arange(256, dtype=torch.uint8)
    for fmt, column in ((torch.float8_e4m3fn, 0), (torch.float8_e5m2, 1)):
        ours = torch.tensor([float.fromhex(line.split()[column]) for line in lines])
        theirs = codes.view(fmt).float()
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])
