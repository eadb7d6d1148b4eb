"""The ``cpu`` backend's C++ small-op chains against the torch reference (fp32, to 1e-5 relative)."""

from __future__ import annotations

import fcntl
import threading

import pytest
import torch

import pd_kernels
import pd_kernels.cpu as cpu
from pd.engine.kv_layout import kv_pool, layer_views
from pd_kernels import PAD_SLOT_ID, reference

TOKENS = [1, 3, 70, 1000]  # one row, a few rows, enough rows to split across threads


def close(actual, expected, tol=1e-5):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_and_rms_norm(tokens):
    torch.manual_seed(tokens)
    x, residual, weight = torch.randn(tokens, 896), torch.randn(tokens, 896), torch.randn(896)
    normed, summed = pd_kernels.rms_norm(x, weight, 1e-6, residual, backend="cpu")
    expected_normed, expected_sum = reference.rms_norm(x, weight, 1e-6, residual)
    close(normed, expected_normed)
    close(summed, expected_sum, 0.0)
    close(pd_kernels.rms_norm(x, weight, 1e-6, backend="cpu"), reference.rms_norm(x, weight, 1e-6))


def test_rms_norm_of_per_head_slices_of_a_fused_projection():
    """Qwen3's q/k norm reads [tokens, heads, head_dim] views whose rows are strided."""
    qkv = torch.randn(5, 8 * 48 + 2 * 2 * 48)
    q = qkv[:, : 8 * 48].view(5, 8, 48)
    weight = torch.randn(48)
    close(pd_kernels.rms_norm(q, weight, 1e-6, backend="cpu"), reference.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_rotary_on_views_of_a_fused_projection(tokens, head_dim):
    heads, kv_heads = 8, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,))
    cos_sin = torch.randn(4096, head_dim)
    q_out, k_out = pd_kernels.rotary_embedding(q, k, positions, cos_sin, backend="cpu")
    q_ref, k_ref = reference.rotary_embedding(q, k, positions, cos_sin)
    close(q_out, q_ref)
    close(k_out, k_ref)


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(tokens):
    gate_up = torch.randn(tokens, 2 * 1408) * 8  # into exp's far tails on both sides
    close(pd_kernels.silu_and_mul(gate_up, backend="cpu"), reference.silu_and_mul(gate_up))


def test_silu_and_mul_refuses_a_bad_shape():
    with pytest.raises(ValueError, match="gate_up must be"):
        pd_kernels.silu_and_mul(torch.randn(4, 7), backend="cpu")


def _heads_inner_pool() -> tuple[torch.Tensor, list]:
    pool = torch.zeros(6, 2, 2, 16, 2, 64)  # [blocks, layers, k/v, block_size, kv_heads, head_dim]
    return pool, [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(2)]


def _engine_pool() -> tuple[torch.Tensor, list]:
    """The engine's layout (pd.engine.kv_layout): a token's heads are not adjacent in the views."""
    pool = kv_pool(6, 2, 16, 2, 64, torch.float32, "cpu")
    return pool.transpose(1, 2), layer_views(pool)  # indexed by layer first, as the other


@pytest.mark.parametrize("make_pool", [_heads_inner_pool, _engine_pool], ids=["heads-inner", "engine"])
def test_store_kv_writes_only_its_slots_and_skips_padding(make_pool):
    by_layer, views = make_pool()
    k_cache, v_cache = views[1]  # strided views, as the engine's per-layer views are
    kv = torch.randn(4, 3 * 2 * 64)
    key, value = kv[:, :128].view(4, 2, 64), kv[:, 128:256].view(4, 2, 64)
    slots = torch.tensor([17, PAD_SLOT_ID, 95, 0])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    pd_kernels.store_kv(key, value, k_cache, v_cache, slots, backend="cpu")
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not by_layer[:, 0].any()  # the other layer is untouched


def test_a_nan_row_stays_in_its_row():
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.ones(64)
    x[2, 5] = float("nan")
    normed, _ = pd_kernels.rms_norm(x, weight, 1e-6, residual, backend="cpu")
    assert normed[2].isnan().all() and not normed[[0, 1, 3]].isnan().any()
    gate_up = torch.randn(4, 128)
    gate_up[1, 0] = float("nan")
    out = pd_kernels.silu_and_mul(gate_up, backend="cpu")
    assert out[1, 0].isnan() and not out[[0, 2, 3]].isnan().any()


def test_other_dtypes_take_the_reference():
    x, weight = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(pd_kernels.rms_norm(x, weight, 1e-6, backend="cpu"), reference.rms_norm(x, weight, 1e-6))
    gate_up = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(pd_kernels.silu_and_mul(gate_up, backend="cpu"), reference.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_copies_whole_blocks_to_their_ids_and_nothing_else(dtype):
    src = torch.randn(6, 2, 16, 4, 8).to(dtype)
    dst = torch.zeros(9, 2, 16, 4, 8, dtype=dtype)
    cpu.copy_blocks(src, [4, 0, 5], dst, [8, 2, 3])
    expected = torch.zeros_like(dst)
    expected[[8, 2, 3]] = src[[4, 0, 5]]
    assert torch.equal(dst, expected)


def test_copy_blocks_splits_many_blocks_over_threads_and_copies_each_once():
    src = torch.randn(64, 2, 16, 4, 8)
    dst = torch.zeros(96, 2, 16, 4, 8)
    order = torch.randperm(96, generator=torch.Generator().manual_seed(0))[:61].tolist()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu.copy_blocks(src, list(range(61)), dst, order)
    finally:
        torch.set_num_threads(threads)
    expected = torch.zeros_like(dst)
    expected[order] = src[:61]
    assert torch.equal(dst, expected)


def test_copy_blocks_refuses_a_bad_id_or_pool():
    src, dst = torch.randn(4, 8), torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.copy_blocks(src, [4], dst, [0])
    with pytest.raises(RuntimeError, match="differ in size"):
        cpu.copy_blocks(src, [0], torch.zeros(4, 16), [0])
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu.copy_blocks(src, [0], torch.zeros(4, 8, dtype=torch.float64), [0])


def test_the_build_runs_the_ninja_this_project_installs(monkeypatch, tmp_path):
    """Whatever ninja PATH finds first (a system one, older), the build runs the ``ninja`` package's: two
    versions keep build logs of different versions, and each starts over on the other's, recompiling the
    whole extension whenever the venv is used activated after ``make venv`` ran it unactivated."""
    import os
    import shutil
    from pathlib import Path

    ninja = pytest.importorskip("ninja")
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.0.0\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("ninja") == str(other)
    with cpu.project_ninja():
        assert Path(shutil.which("ninja")).resolve() == (Path(ninja.BIN_DIR) / "ninja").resolve()
    assert shutil.which("ninja") == str(other)


def test_a_lock_left_by_a_stopped_build_is_removed_and_a_running_builder_is_waited_for(tmp_path):
    leftover = tmp_path / "lock"  # torch's: a build killed before it finished leaves it
    leftover.write_text("")
    with cpu.one_builder(tmp_path):
        assert not leftover.exists()
    # Another builder holds the lock (flock: another open file waits, in this process too) with its own
    # torch lock in place: that one is left alone until the builder is gone.
    holder = open(tmp_path / "pd-builder.flock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    leftover.write_text("")
    entered = threading.Event()

    def build() -> None:
        with cpu.one_builder(tmp_path):
            entered.set()

    waiter = threading.Thread(target=build)
    waiter.start()
    assert not entered.wait(0.3) and leftover.exists()
    holder.close()  # the builder dies: the kernel drops its lock, its torch lock stays behind
    waiter.join(10)
    assert entered.is_set() and not leftover.exists()
