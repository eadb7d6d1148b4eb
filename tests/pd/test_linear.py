"""Dense layers: the oneDNN path pads rows to a bounded set of shapes and still computes x @ W^T + b."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pd_kernels.cpu
from pd.model import linear
from pd.model.linear import EXACT_ROWS, FEW_ROWS, FORMS, choose_form, make_linear, padded_rows


def test_padded_rows_bounds_the_shapes_and_the_waste():
    sizes = {padded_rows(n) for n in range(1, 4097)}
    assert len(sizes) <= EXACT_ROWS + 8 * 6
    for n in range(1, 4097):
        assert n <= padded_rows(n) <= max(n, n * 9 // 8 + 1)
    assert [padded_rows(n) for n in (64, 65, 129, 2049)] == [64, 72, 144, 2304]


@pytest.mark.parametrize("few_rows", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("num_rows", [1, 7, 8, 9, 64, 65, 130, 300])
def test_linear_matches_the_dense_product(num_rows, form, few_rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(num_rows, 40)
    expected = x.double() @ weight.double().t() + bias.double()
    layer = make_linear(weight, bias, form, few_rows)
    assert layer.packed == (form == "onednn")
    assert (layer.rows_kernel is not None) == (few_rows and form == "onednn")
    got = layer(x)
    assert got.shape == (num_rows, 96)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


CPU = torch.device("cpu")


def test_a_few_row_batch_runs_in_the_few_row_kernel_and_a_larger_one_in_onednn():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    calls = []

    def kernel(x, panels, b, out_features):  # the real kernel, counted
        calls.append(x.shape[0])
        return pd_kernels.cpu.build().linear_rows(x, panels, b, out_features)

    layer = dataclasses.replace(make_linear(weight, bias, "onednn", few_rows=True), rows_kernel=kernel)
    plain = make_linear(weight, bias, "onednn")
    for num_rows in (1, FEW_ROWS):
        x = torch.randn(num_rows, 40)
        assert torch.equal(layer(x), pd_kernels.cpu.linear_rows(x, weight, bias))
    x = torch.randn(FEW_ROWS + 1, 40)
    assert torch.equal(layer(x), plain(x))
    assert calls == [1, FEW_ROWS]


def test_the_few_row_kernel_multiplies_fp32_weights_only(monkeypatch):
    if linear.bf16_supported():  # oneDNN's own bf16 GEMM (AVX-512 or AVX-NE-CONVERT hosts)
        native = make_linear(torch.randn(8, 4).bfloat16(), None, "onednn", few_rows=True)
        assert native.rows_kernel is None and native.packed and native.output_dtype is None
    monkeypatch.setattr(linear, "bf16_supported", lambda: False)  # bf16 held as fp32: the kernel runs it
    held = make_linear(torch.randn(8, 4).bfloat16(), None, "onednn", few_rows=True)
    assert held.rows_kernel is not None and held.output_dtype == torch.bfloat16


def test_a_form_asked_for_is_kept_and_oneDNN_falls_back_where_it_cannot_run():
    assert choose_form("dense", CPU, torch.float32, 4096, 4096).form == "dense"
    assert choose_form("onednn", CPU, torch.float32, 4096, 4096).form == "onednn"
    assert choose_form("dense", CPU, torch.float16, 4096, 4096).form == "dense"
    fp16 = make_linear(torch.randn(8, 4).half(), None, "onednn")  # no oneDNN fp16 here: held in fp32
    assert fp16.packed and fp16.output_dtype == torch.float16
    assert fp16(torch.randn(3, 4).half()).dtype == torch.float16
    with pytest.raises(ValueError, match="form must be one of"):
        make_linear(torch.randn(8, 4), None, "mkl")


def test_auto_takes_onednn_unmeasured_where_the_few_row_kernel_runs_the_decode_steps(monkeypatch):
    monkeypatch.setattr(linear, "time_forms", lambda *args: {1: 0.5, 256: 1.0})  # dense's one win: one row
    monkeypatch.setattr(linear, "bf16_supported", lambda: True)
    assert choose_form("auto", CPU, torch.float32, 4096, 4096).form == "dense"
    assert choose_form("auto", CPU, torch.float32, 4096, 4096, few_rows=True) == linear.FormChoice("onednn", {})
    bf16 = choose_form("auto", CPU, torch.bfloat16, 4096, 4096, few_rows=True)
    assert bf16 == linear.FormChoice("onednn", {})  # unmeasured: a bf16 "dense" layer is unpacked oneDNN


def test_auto_measures_a_large_layer_and_leaves_a_small_one_on_onednn(monkeypatch):
    small = choose_form("auto", CPU, torch.float32, 256, 256)
    assert small.form == "onednn" and small.dense_over_onednn == {}  # unmeasured: same arithmetic everywhere
    monkeypatch.setattr(linear, "PROBE_BYTES", 4 * 1024**2)  # a quick probe: 4 copies of 1 MiB
    chosen = choose_form("auto", CPU, torch.float32, 1024, 1024)
    assert chosen.form in FORMS and set(chosen.dense_over_onednn) == set(linear.PROBE_ROWS)
    assert all(ratio > 0 for ratio in chosen.dense_over_onednn.values())


@pytest.mark.parametrize("ratios, form", [({1: 0.7, 256: 1.1}, "dense"), ({1: 1.1, 256: 0.9}, "onednn"),
                                          ({1: 0.7, 256: 2.5}, "onednn")])
def test_dense_wins_only_faster_at_one_row_and_not_far_slower_at_many(monkeypatch, ratios, form):
    monkeypatch.setattr(linear, "time_forms", lambda *args: ratios)
    assert choose_form("auto", CPU, torch.float32, 4096, 4096).form == form
