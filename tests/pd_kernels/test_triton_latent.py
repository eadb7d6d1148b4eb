"""Triton multi-head latent attention against the torch reference, in the interpreter.

The latent pool is the K plane of ``paged_batch``'s pool with one KV head: a strided view
``[num_blocks, block_size, 1, latent_dim]`` whose rows are contiguous, poisoned with NaN wherever no
sequence's key lives. Latent rows are small (``v_dim + rope``: 32 + 16, the non-power-of-two 48 + 16,
32 + 0) but for one DeepSeek-V3 row (512 + 64); heads 1, 4, 16 (32 on CUDA); decode-only and mixed batches
(a prefill chunk after a prefix, an empty query, padding tokens); single pass and split-KV, over the
interpreter's one 256-key tile and the GPU's 16-key tiles; FP8 pages; ``out=`` given, strided.

bf16 is left to CUDA: the interpreter computes it wrongly.
"""

from __future__ import annotations

import pytest
import torch

import pd_kernels
from pd_kernels import reference
from pd_kernels.triton import split_latent_attention
from pd_kernels.triton.latent_attention import LatentTiles, launch_latent_attention
from tests.pd_kernels.paged_batch import make_batch
from tests.pd_kernels.test_triton_attention import assert_matches_reference

ON_CUDA = torch.get_default_device().type == "cuda"
BF16 = pytest.mark.skipif(not ON_CUDA, reason="the interpreter computes bf16 wrongly")
MIXED = [(1, 70), (9, 40), (0, 5), (1, 1)]  # a decode, a chunk after a prefix, no query this step, a first token
DECODE = [(1, 53), (1, 17), (1, 130)]


def _latent_batch(batch, num_heads: int, latent_dim: int, dtype: torch.dtype, kv_dtype=None, seed: int = 0):
    """The batch's args with the latent pool (poisoned), and the reference's (clean)."""
    paged = make_batch(batch, num_heads, 1, latent_dim, 16, dtype, seed=seed, kv_dtype=kv_dtype)
    clean, poisoned = paged.args(), paged.args(paged.poisoned_pool())
    return ((clean[0], clean[1], *clean[3:]), (poisoned[0], poisoned[1], *poisoned[3:]))


# num_heads, (v_dim, rope_dim), batch, dtype
CASES = [
    (4, (32, 16), MIXED, torch.float32),
    (16, (32, 16), DECODE, torch.float16),
    (1, (48, 16), MIXED, torch.float16),
    (16, (48, 16), MIXED, torch.float32),
    (4, (32, 0), DECODE, torch.float32),
    (16, (512, 64), DECODE, torch.float32),
    pytest.param(32, (512, 64), MIXED, torch.bfloat16, marks=BF16),  # 32 heads a program on a GPU
]


def _case_id(case) -> str:
    heads, (v_dim, rope_dim), batch, dtype = case
    return f"h{heads}-{v_dim}+{rope_dim}-{'mixed' if batch is MIXED else 'decode'}-{str(dtype)[6:]}"


@pytest.mark.parametrize(("heads", "dims", "batch", "dtype"), CASES,
                         ids=[_case_id(c.values if hasattr(c, "values") else c) for c in CASES])
def test_latent_attention_matches_reference(heads, dims, batch, dtype):
    v_dim, rope_dim = dims
    expected_args, args = _latent_batch(batch, heads, v_dim + rope_dim, dtype)
    scale = (v_dim + rope_dim) ** -0.5
    expected = reference.latent_attention(*expected_args, scale, v_dim=v_dim)
    actual = pd_kernels.latent_attention(*args, scale, v_dim=v_dim, backend="triton")
    assert actual.shape == (args[0].shape[0], heads, v_dim)
    assert_matches_reference(actual, expected)


@pytest.mark.parametrize("batch", [DECODE, MIXED], ids=["decode", "mixed"])
def test_split_kv_matches_reference(batch):
    expected_args, args = _latent_batch(batch, 4, 48 + 16, torch.float32, seed=1)
    expected = reference.latent_attention(*expected_args, 0.2, v_dim=48)
    # 3 splits of a 256-key tile walk: most tokens leave splits empty, which the merge must weigh 0.
    actual = split_latent_attention(*args, 0.2, v_dim=48, num_splits=3)
    assert_matches_reference(actual, expected)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_walks_many_small_tiles(num_splits):
    """The GPU's 16-key tiles: the online softmax carried over many tiles, and splits of several each."""
    expected_args, args = _latent_batch(MIXED, 4, 32 + 16, torch.float32, seed=4)
    expected = reference.latent_attention(*expected_args, 0.25, v_dim=32)
    out = torch.empty(args[0].shape[0], 4, 32)
    launch_latent_attention(*args, 0.25, 32, 1.0, out, LatentTiles(block_h=16, tile=16, num_warps=4, num_stages=1),
                            num_splits)
    assert_matches_reference(out, expected)


def test_writes_into_a_strided_out_and_nowhere_else():
    expected_args, args = _latent_batch(MIXED, 4, 48, torch.float32, seed=2)
    expected = reference.latent_attention(*expected_args, 0.3, v_dim=32)
    num_tokens = args[0].shape[0]
    q = torch.cat([args[0], torch.randn(2, 4, 48)])  # two padding tokens past the batch's last
    storage = torch.full((num_tokens + 2, 4, 40), 7.0)
    out = storage[:, :, :32]
    result = pd_kernels.latent_attention(q, *args[1:], 0.3, v_dim=32, out=out, backend="triton")
    assert result.data_ptr() == out.data_ptr()
    assert_matches_reference(out[:num_tokens], expected)
    assert bool((storage[:, :, 32:] == 7.0).all()) and bool((storage[num_tokens:] == 7.0).all())


FP8_CASES = [
    (torch.float8_e4m3fn, 4, (32, 16), MIXED, torch.float32, 1),
    (torch.float8_e5m2, 16, (48, 16), DECODE, torch.float16, 1),
    (torch.float8_e4m3fn, 16, (32, 16), DECODE, torch.float16, 2),
    pytest.param(torch.float8_e4m3fn, 16, (512, 64), MIXED, torch.bfloat16, 1, marks=BF16),
]


@pytest.mark.parametrize(("kv_dtype", "heads", "dims", "batch", "dtype", "num_splits"), FP8_CASES,
                         ids=["e4m3-fp32-mixed", "e5m2-fp16-decode", "e4m3-fp16-split", "e4m3-bf16-v3"])
def test_reads_fp8_pages_as_the_reference(kv_dtype, heads, dims, batch, dtype, num_splits):
    v_dim, rope_dim = dims
    expected_args, args = _latent_batch(batch, heads, v_dim + rope_dim, dtype, kv_dtype=kv_dtype, seed=3)
    expected = reference.latent_attention(*expected_args, 0.05, v_dim=v_dim, scale=3.0)
    if num_splits == 1:
        actual = pd_kernels.latent_attention(*args, 0.05, v_dim=v_dim, scale=3.0, backend="triton")
    else:
        actual = split_latent_attention(*args, 0.05, v_dim=v_dim, num_splits=num_splits, scale=3.0)
    # Outputs are about the scale: compare them at scale 1.
    assert_matches_reference(actual / 3.0, expected / 3.0)
