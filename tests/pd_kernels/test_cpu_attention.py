"""The ``cpu`` backend's C++ decode attention against the torch reference (fp32 exact to 1e-4)."""

from __future__ import annotations

import pytest
import torch

import pd_kernels
from pd_kernels import reference
from tests.pd_kernels.paged_batch import make_batch

DECODE = [(1, 523), (1, 37), (1, 2011), (1, 1)]
MIXED = [(1, 1328), (5, 18), (129, 463), (1, 16)]
# Prefill chunks on both sides of pd_kernels.cpu.MAX_PAGED_PREFILL_KEYS (ours up to it, SDPA past it),
# a decode row among them.
LONG = [(40, 700), (1, 300), (300, 300), (7, 513), (512, 512), (3, 1025), (2, 1024)]

# (num_heads, num_kv_heads), head_dim, block_size, batch, sliding_window, softcap
CASES = [
    ((4, 4), 64, 16, DECODE, None, None),
    ((8, 2), 128, 32, MIXED, 64, None),
    ((5, 1), 64, 32, DECODE, None, 50.0),
    ((8, 2), 48, 16, MIXED, 64, 50.0),  # Qwen3's head_dim in the tests
    ((14, 2), 80, 16, DECODE, 17, None),
    ((8, 8), 96, 32, MIXED, None, 30.0),
    # The shapes the kernel specialises at compile time: head dim 64/128 with GQA group 4, 7 or 8.
    ((8, 2), 64, 16, MIXED, None, None),
    ((28, 4), 64, 32, DECODE, 40, None),
    ((16, 2), 128, 16, DECODE, None, 50.0),
    ((14, 2), 128, 16, MIXED, None, None),
    ((8, 2), 32, 16, LONG, None, None),  # the built-in model's head dim
    ((8, 2), 64, 32, LONG, 100, 30.0),
    ((8, 2), 128, 16, LONG, None, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0][0]}/{c[0][1]}-d{c[1]}-b{c[2]}-w{c[4]}-cap{c[5]}")
def test_cpu_attention_matches_reference_and_reads_only_live_slots(case):
    (heads, kv_heads), head_dim, block_size, batch, window, softcap = case
    paged = make_batch(batch, heads, kv_heads, head_dim, block_size, torch.float32)
    scale = head_dim**-0.5
    expected = reference.unified_attention(*paged.args(), scale, sliding_window=window, softcap=softcap)
    # NaN in every slot a query must not read (past its length, padding pages, the other layer).
    actual = pd_kernels.unified_attention(*paged.args(paged.poisoned_pool()), scale, sliding_window=window,
                                       softcap=softcap, backend="cpu")
    assert not actual.isnan().any()
    assert (actual - expected).abs().max().item() <= 1e-4


def test_a_nan_in_one_sequence_stays_in_that_sequence():
    paged = make_batch(DECODE, 8, 2, 64, 16, torch.float32)
    q = paged.q.clone()
    q[1] = float("nan")
    out = pd_kernels.unified_attention(q, *paged.args()[1:], 0.125, backend="cpu")
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()


@pytest.mark.parametrize("batch", [MIXED, LONG[:3]], ids=["mixed", "long"])
def test_bf16_runs_in_fp32_on_the_kernels_as_the_reference_does(batch):
    # Both compute in fp32 from the same bf16 values; the outputs differ by the bf16 rounding of fp32 sums.
    paged = make_batch(batch, 8, 2, 64, 16, torch.bfloat16)
    expected = reference.unified_attention(*paged.args(), 0.125)
    actual = pd_kernels.unified_attention(*paged.args(paged.poisoned_pool()), 0.125, backend="cpu")
    assert actual.dtype == torch.bfloat16 and not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1e-2)
    out = torch.full_like(paged.q, float("nan"))
    assert pd_kernels.unified_attention(*paged.args(), 0.125, out=out, backend="cpu") is out
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_fp16_pages_take_the_reference():
    paged = make_batch(MIXED, 8, 2, 64, 16, torch.float16)
    expected = reference.unified_attention(*paged.args(), 0.125)
    actual = pd_kernels.unified_attention(*paged.args(), 0.125, backend="cpu")
    assert torch.equal(actual, expected)


def test_auto_is_the_cpu_kernel_on_cpu():
    assert pd_kernels.resolve_backend("auto", torch.device("cpu")) == "cpu"
