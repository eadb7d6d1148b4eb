"""Triton store_kv, rms_norm and rotary_embedding against the torch reference."""

from __future__ import annotations

import pytest
import torch

import pd_kernels
from pd.engine.kv_layout import layer_views
from pd_kernels import PAD_SLOT_ID, reference

DTYPES = [torch.float32, torch.float16]


def _assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_store_kv_writes_slots_and_skips_padding(backend, dtype, head_dim):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads = 6, 16, 2
    pool = torch.randn(num_blocks, kv_heads, 2, 2, block_size, head_dim).to(dtype)  # the engine's (kv_layout)
    # Strided per-token K/V, as split from a fused QKV projection.
    kv = torch.randn(9, 2, kv_heads, head_dim + 8).to(dtype)
    key, value = kv[:, 0, :, :head_dim], kv[:, 1, :, :head_dim]
    slots = [3, PAD_SLOT_ID, 40, 95, 17, -7, 0, 16, 61]
    expected = pool.clone()
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // block_size, :, 1, 0, slot % block_size] = key[token]
            expected[slot // block_size, :, 1, 1, slot % block_size] = value[token]

    slot_mapping = torch.tensor(slots, dtype=torch.int32)
    k_cache, v_cache = layer_views(pool)[1]
    pd_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping, backend=backend)

    assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(dtype, with_residual):
    torch.manual_seed(0)
    x = torch.randn(37, 96).to(dtype)
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    residual = torch.randn(37, 96).to(dtype) if with_residual else None
    actual = pd_kernels.rms_norm(x, weight, 1e-6, residual, backend="triton")
    expected = reference.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        _assert_close(actual[0], expected[0])
        assert torch.equal(actual[1], expected[1])
    else:
        _assert_close(actual, expected)


def test_rms_norm_per_head_on_a_strided_view():
    """Qwen3's q/k norm: per-head RMSNorm of q sliced out of a fused projection."""
    torch.manual_seed(0)
    qkv = torch.randn(11, 4 * 48 + 2 * 48)
    q = qkv[:, : 4 * 48].view(11, 4, 48)
    weight = torch.randn(48)
    _assert_close(pd_kernels.rms_norm(q, weight, 1e-6, backend="triton"), reference.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_rotary_matches_reference(dtype, head_dim):
    torch.manual_seed(0)
    num_tokens, heads, kv_heads, max_positions = 13, 4, 2, 300
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    angles = torch.arange(max_positions).unsqueeze(1) * inv_freq  # [max_positions, head_dim / 2]
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, max_positions, (num_tokens,))

    actual_q, actual_k = pd_kernels.rotary_embedding(q, k, positions, cos_sin_cache, backend="triton")
    expected_q, expected_k = reference.rotary_embedding(q, k, positions, cos_sin_cache)
    _assert_close(actual_q, expected_q)
    _assert_close(actual_k, expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows_cols", [(1, 7), (5, 1408), (3, 5000)], ids=str)  # 5000: several column blocks on a GPU
def test_silu_and_mul_matches_reference(dtype, rows_cols):
    torch.manual_seed(0)
    rows, cols = rows_cols
    gate_up = (torch.randn(rows, 2 * cols) * 4).to(dtype)
    _assert_close(pd_kernels.silu_and_mul(gate_up, backend="triton"), reference.silu_and_mul(gate_up))
