"""The prefill path of Triton unified attention against the torch reference (interpreted here, compiled under
``make gpu-check``): which batches take it, and its three walks over the keys (a sliding window's edge, the
tiles every row sees, the diagonal) at tiles small enough that each walk runs several tiles."""

from __future__ import annotations

import pytest
import torch

import pd_kernels
from pd_kernels import reference
from pd_kernels.triton import attention
from pd_kernels.triton.paged_attention import TileConfig
from pd_kernels.triton.prefill_attention import (
    PREFILL_PATH_TOKENS,
    head_dim_parts,
    launch_prefill_attention,
    takes_prefill_path,
)
from tests.pd_kernels.conftest import DEVICE
from tests.pd_kernels.paged_batch import make_batch
from tests.pd_kernels.test_triton_attention import assert_matches_reference

# A whole prompt, a chunk after a prefix whose end is inside a tile and off the q blocks' grid, a decode, a chunk
# of one token past a prefix.
PROMPTS = [(70, 70), (45, 90), (1, 120), (1, 33)]


def test_the_path_is_chosen_from_host_sizes():
    assert takes_prefill_path(PREFILL_PATH_TOKENS + 3, 3)
    assert not takes_prefill_path(PREFILL_PATH_TOKENS + 2, 3)
    assert not takes_prefill_path(64, 64)  # decode-only


def test_unified_attention_takes_the_prefill_path_for_long_chunks(monkeypatch):
    paged = make_batch([(140, 150), (1, 40)], 4, 2, 64, 16, torch.float32, seed=4)
    launched = []
    launch = attention.launch_prefill_attention
    monkeypatch.setattr(attention, "launch_prefill_attention", lambda *a, **k: launched.append(1) or launch(*a, **k))
    expected = reference.unified_attention(*paged.args(), 0.125)
    actual = pd_kernels.unified_attention(*paged.args(paged.poisoned_pool()), 0.125, backend="triton")
    assert launched == [1]
    assert_matches_reference(actual, expected)


def test_small_mixed_batches_keep_the_single_pass():
    paged = make_batch([(9, 30), (1, 17)], 4, 2, 64, 16, torch.float32, seed=5)
    assert not takes_prefill_path(10, 2)
    expected = reference.unified_attention(*paged.args(), 0.125)
    assert_matches_reference(pd_kernels.unified_attention(*paged.args(), 0.125, backend="triton"), expected)


def test_head_dims_run_as_two_products_where_two_pad_less_than_one():
    assert head_dim_parts(80) == (64, 16) and head_dim_parts(96) == (64, 32) and head_dim_parts(48) == (32, 16)
    assert head_dim_parts(88) == (64, 32)  # 96 wide, its last 8 masked: less than 128
    assert head_dim_parts(128) == (128, 0) and head_dim_parts(64) == (64, 0)
    assert head_dim_parts(72) == (128, 0)  # 64 + 8: a product takes at least 16
    assert head_dim_parts(112) == (128, 0)  # 64 + 64 pads as much as 128


# (num_heads, num_kv_heads), head_dim, block_size, sliding_window, softcap, dtype, block_m, tile
CASES = [
    ((4, 2), 64, 16, None, None, torch.float32, 16, 16),
    ((4, 2), 64, 16, 24, None, torch.float32, 16, 16),  # a window narrower than a q block's span
    ((8, 2), 80, 32, 40, 30.0, torch.float16, 32, 32),
    pytest.param(((5, 1), 48, 16, None, 50.0, torch.float16, 16, 32), marks=pytest.mark.slow),  # 32 + 16: full tier
    ((4, 2), 88, 16, 24, None, torch.float32, 16, 16),  # 64 + 32 head dims, the last 8 masked
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0][0]}/{c[0][1]}-d{c[1]}-w{c[3]}-cap{c[4]}-m{c[6]}-t{c[7]}")
def test_small_tiles_walk_every_kind_of_key_tile(case):
    (heads, kv_heads), head_dim, block_size, window, softcap, dtype, block_m, tile = case
    paged = make_batch(PROMPTS, heads, kv_heads, head_dim, block_size, dtype, seed=6)
    scale = head_dim**-0.5
    expected = reference.unified_attention(*paged.args(), scale, sliding_window=window, softcap=softcap)
    out = torch.full_like(paged.q, float("nan"))
    group = heads // kv_heads
    block_m = max(block_m, 1 << (group - 1).bit_length())
    tiles = TileConfig(block_m=block_m, block_q=block_m // group, tile=tile, num_warps=4, num_stages=2)
    launch_prefill_attention(*paged.args(paged.poisoned_pool()), scale, window, softcap, out, tiles)
    assert_matches_reference(out, expected)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


Q_DTYPES = [torch.float16, torch.float32] if DEVICE == "cpu" else [torch.bfloat16, torch.float16]
# Every pages format and query dtype at head dim 64, and one with the head dims in two products (80: 64 + 16).
# The interpreter's slowest cases (fp32 queries, and head dim 80) run in the full tier.
FP8_CASES = [pytest.param(kv_dtype, q_dtype, 64, marks=[pytest.mark.slow] if q_dtype == torch.float32 else [])
             for kv_dtype in FP8 for q_dtype in Q_DTYPES]
FP8_CASES.append(pytest.param(FP8[0], Q_DTYPES[0], 80, marks=pytest.mark.slow))


@pytest.mark.parametrize(("kv_dtype", "q_dtype", "head_dim"), FP8_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_fp8_pages_read_as_the_reference(kv_dtype, q_dtype, head_dim):
    paged = make_batch(PROMPTS, 4, 2, head_dim, 16, q_dtype, seed=7, kv_dtype=kv_dtype)
    k_scale, v_scale = 0.37, 3.0
    expected = reference.unified_attention(*paged.args(), 0.125, k_scale=k_scale, v_scale=v_scale)
    out = torch.empty_like(paged.q)
    tiles = TileConfig(block_m=16, block_q=8, tile=16, num_warps=4, num_stages=2)
    launch_prefill_attention(*paged.args(), 0.125, None, None, out, tiles, k_scale=k_scale, v_scale=v_scale)
    # fp16 products: q is rounded to fp16 once (module doc of prefill_attention)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1e-2)
