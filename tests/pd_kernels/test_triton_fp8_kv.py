"""Triton FP8 KV pages: the store bit for bit against the reference (ties, saturation, NaN), and
attention (single pass, split-KV) over FP8 pools poisoned with NaN where nothing may read.

Shapes are tiny: the interpreter runs each case in well under a second. Under
``make gpu-check`` the same cases run compiled; the expected bytes are then
still the CPU reference's (``pd_kernels.fp8``: ``x / scale`` in IEEE division),
since torch's CUDA division by a scalar multiplies by its reciprocal.
"""

from __future__ import annotations

import pytest
import torch

import pd_kernels
from pd.engine.kv_layout import layer_views
from pd_kernels import PAD_SLOT_ID, fp8, reference
from tests.pd_kernels.paged_batch import LAYER, make_batch
from tests.pd_kernels.test_fp8_kv import _hard_values
from tests.pd_kernels.test_triton_attention import assert_matches_reference

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
ON_CUDA = torch.get_default_device().type == "cuda"


def _fmt(dtype: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}[dtype]


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 3.0)], ids=["scale-1", "scales-0.37-3"])
@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
def test_store_writes_the_references_bytes(dtype, scales):
    """Every code, every midpoint (ties to even), just off them, overflow (saturates), NaN, padding slots.

    V gets the values negated but for NaN: a NaN's sign is not kept on a GPU, whose division returns the
    canonical (positive) NaN."""
    k_scale, v_scale = scales
    head_dim, kv_heads, block_size = 64, 2, 16
    device = torch.get_default_device()
    with torch.device("cpu"):  # inputs and the expected bytes: the CPU reference's, on any test device
        values = _hard_values(dtype)
        values = torch.cat([values, torch.zeros(-values.numel() % (head_dim * kv_heads))])
        values = values.view(-1, kv_heads, head_dim)
        negated = torch.where(values.isnan(), values, -values)
        num_tokens = values.shape[0]
        slots = torch.arange(num_tokens)
        slots[::7] = PAD_SLOT_ID  # skipped: their slots keep the pool's bytes
        num_blocks = -(-num_tokens // block_size)
        pool = torch.randn(num_blocks, kv_heads, 2, 2, block_size, head_dim).to(dtype)  # the engine's layout
        expected = pool.clone()
        k_ref, v_ref = layer_views(expected)[LAYER]
        reference.store_kv(values, negated, k_ref, v_ref, slots, k_scale=k_scale, v_scale=v_scale)
    pool = pool.to(device)
    k_cache, v_cache = layer_views(pool)[LAYER]
    pd_kernels.store_kv(values.to(device), negated.to(device), k_cache, v_cache, slots.to(device), k_scale=k_scale,
                     v_scale=v_scale, backend="triton")
    actual = pool.cpu().view(torch.uint8)
    assert torch.equal(actual, expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
@pytest.mark.parametrize("key_dtype", [torch.float16, torch.bfloat16])
def test_store_from_half_keys(dtype, key_dtype):
    key = (torch.randn(33, 1, 48, generator=torch.Generator().manual_seed(1), device="cpu") * 300).to(key_dtype)
    stored = {}
    for device in ("cpu", torch.get_default_device()):
        k = torch.zeros(3, 16, 1, 48, dtype=dtype, device=device)
        v = torch.zeros_like(k)
        backend = "torch" if device == "cpu" else "triton"
        pd_kernels.store_kv(key.to(device), key.to(device), k, v, torch.arange(33, device=device), k_scale=0.5,
                         v_scale=2.0, backend=backend)
        stored[backend] = (k.cpu().view(torch.uint8), v.cpu().view(torch.uint8))
    assert torch.equal(stored["triton"][0], stored["torch"][0])
    assert torch.equal(stored["triton"][1], stored["torch"][1])


E4M3, E5M2 = FORMATS
DECODE = [(1, 40), (1, 7), (1, 100)]
MIXED = [(1, 60), (5, 18), (9, 30)]
BF16 = pytest.mark.skipif(not ON_CUDA, reason="the interpreter computes bf16 wrongly")
# pages, (num_heads, num_kv_heads), head_dim, block_size, batch, sliding_window, softcap, q dtype
CASES = [
    (E4M3, (8, 2), 64, 16, DECODE, None, None, torch.float32),
    (E5M2, (4, 4), 48, 32, MIXED, 16, 30.0, torch.float32),
    (E4M3, (5, 1), 64, 16, MIXED, None, 30.0, torch.float16),
    (E5M2, (8, 2), 64, 32, DECODE, 16, None, torch.float16),
    pytest.param(E4M3, (8, 2), 128, 16, MIXED, None, None, torch.bfloat16, marks=BF16),
    pytest.param(E5M2, (8, 2), 128, 16, DECODE, None, None, torch.bfloat16, marks=BF16),
]
SCALES = {"k_scale": 0.05, "v_scale": 3.0}


def _check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Outputs are about v_scale: compare them at scale 1.
    assert_matches_reference(actual / SCALES["v_scale"], expected / SCALES["v_scale"])


def _case_id(value) -> str | None:
    if isinstance(value, torch.dtype):
        return _fmt(value) if value in FORMATS else str(value)[6:]
    if value is DECODE or value is MIXED:
        return "decode" if value is DECODE else "mixed"
    return None


@pytest.mark.parametrize(("dtype", "heads", "head_dim", "block_size", "batch", "window", "softcap", "q_dtype"),
                         CASES, ids=_case_id)
def test_attention_reads_fp8_pages_as_the_reference(dtype, heads, head_dim, block_size, batch, window, softcap,
                                                    q_dtype):
    heads, kv_heads = heads
    paged = make_batch(batch, heads, kv_heads, head_dim, block_size, q_dtype, kv_dtype=dtype)
    kwargs = dict(sliding_window=window, softcap=softcap, **SCALES)
    expected = reference.unified_attention(*paged.args(), head_dim**-0.5, **kwargs)
    actual = pd_kernels.unified_attention(*paged.args(paged.poisoned_pool()), head_dim**-0.5, backend="triton", **kwargs)
    _check(actual, expected)


@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
def test_split_kv_reads_fp8_pages(dtype):
    from pd_kernels.triton import split_kv_attention

    paged = make_batch(DECODE, 8, 2, 64, 16, torch.float32, seed=3, kv_dtype=dtype)
    expected = reference.unified_attention(*paged.args(), 0.125, softcap=50.0, **SCALES)
    actual = split_kv_attention(*paged.args(paged.poisoned_pool()), 0.125, num_splits=3, softcap=50.0, **SCALES)
    _check(actual, expected)


@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
def test_every_code_reads_as_torch_reads_it(dtype):
    # Two decodes of one key each: the output is that key's value row, so each code's value, exactly.
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes.view(dtype).float().isnan()] = 0
    paged = make_batch([(1, 1), (1, 1)], 2, 1, 128, 16, torch.float32, kv_dtype=dtype)
    first = paged.block_table[:, 0].long()
    paged.pool.view(torch.uint8)[first, 0, LAYER, 1, 0] = codes.view(2, 128).to(paged.pool.device)
    out = pd_kernels.unified_attention(*paged.args(), 0.1, v_scale=0.5, backend="triton")
    expected = codes.view(dtype).float().view(2, 128).to(out.device) * 0.5
    assert torch.equal(out[:, 0], expected) and torch.equal(out[:, 1], expected)


@pytest.mark.parametrize("dtype", FORMATS, ids=_fmt)
def test_a_nan_code_reaches_its_rows_output(dtype):
    paged = make_batch([(1, 20), (1, 20)], 4, 1, 64, 16, torch.float32, kv_dtype=dtype)
    nan_code = fp8.quantize(torch.tensor([float("nan")]), 1.0, dtype).view(torch.uint8).item()
    paged.pool.view(torch.uint8)[paged.block_table[0, 0].long(), 0, LAYER, 0, 3, 5] = nan_code
    out = pd_kernels.unified_attention(*paged.args(), 0.1, backend="triton")
    assert out[0].isnan().all() and not out[1].isnan().any()
