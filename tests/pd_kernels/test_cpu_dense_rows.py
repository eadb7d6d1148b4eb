"""The ``cpu`` backend's few-row dense layer against the torch reference (fp32)."""

from __future__ import annotations

import pytest
import torch

import pd_kernels.cpu as cpu
from pd_kernels import reference

# (out_features, in_features): tails in both (not a multiple of the 4 accumulated rows of W, nor of a
# vector), the built-in model's layers, and a layer split across threads.
SHAPES = [(7, 33), (1000, 250), (384, 256), (256, 768), (4099, 64)]


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 9, 13, 17])
def test_matches_the_reference(out_features, in_features, num_rows):
    torch.manual_seed(num_rows)
    x, weight, bias = torch.randn(num_rows, in_features), torch.randn(out_features, in_features), torch.randn(out_features)
    for b in (bias, None):
        got = cpu.linear_rows(x, weight, b)
        assert got.shape == (num_rows, out_features) and got.is_contiguous()
        torch.testing.assert_close(got, reference.linear_rows(x, weight, b), atol=1e-4, rtol=1e-5)


def test_reads_strided_rows():
    """Rows of a wider buffer (the logits' rows picked out of a batch) are read in place."""
    wide, weight = torch.randn(5, 100), torch.randn(30, 64)
    x = wide[:, 8:72]
    torch.testing.assert_close(cpu.linear_rows(x, weight), reference.linear_rows(x, weight), atol=1e-4, rtol=1e-5)


def test_a_nan_reaches_its_row_only():
    x, weight = torch.randn(3, 40), torch.randn(20, 40)
    x[1, 5] = float("nan")
    got = cpu.linear_rows(x, weight)
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


def test_other_dtypes_take_the_reference():
    x, weight = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    assert torch.equal(cpu.linear_rows(x, weight), reference.linear_rows(x, weight))


@pytest.mark.parametrize("x, weight, bias, message", [
    (torch.randn(2, 16), torch.randn(8, 12), None, "weight: has 12 input features, x has 16"),
    (torch.randn(16), torch.randn(8, 16), None, "x: expected 2 dimensions"),
    (torch.randn(2, 16), torch.randn(16, 8).t(), None, "weight: must be contiguous"),
    (torch.randn(2, 16), torch.randn(8, 16), torch.randn(7), r"bias: expected shape \(8,\)"),
    (torch.randn(2, 16), torch.randn(8, 16).double(), None, "weight: expected dtype"),
])
def test_bad_arguments_are_named(x, weight, bias, message):
    with pytest.raises(ValueError, match=message):
        cpu.linear_rows(x, weight, bias)


def test_the_extension_checks_what_a_dense_layer_passes_it_directly():
    """``Linear`` calls the extension without the Python checks; the C++ ones still fail clearly."""
    kernel = cpu.build().linear_rows
    panels = cpu.pack_rows_weight(torch.randn(8, 12))
    with pytest.raises(RuntimeError, match="weight has 12 input features, x has 16"):
        kernel(torch.randn(2, 16), panels, None, 8)
    with pytest.raises(RuntimeError, match="panels must be pack_rows_weight's for 40 outputs"):
        kernel(torch.randn(2, 12), panels, None, 40)
    with pytest.raises(RuntimeError, match="fp32 only"):
        kernel(torch.randn(2, 12).double(), panels, None, 8)
    with pytest.raises(RuntimeError, match="weight must be a 2-D fp32 CPU tensor"):
        cpu.pack_rows_weight(torch.randn(8, 12).double())


def test_panels_hold_the_weight_and_zero_padding():
    weight = torch.randn(21, 5)
    panels = cpu.pack_rows_weight(weight)
    lanes = panels.shape[2]
    assert panels.shape == (-(-21 // lanes), 5, lanes)
    flat = panels.transpose(1, 2).reshape(-1, 5)  # back to [padded out, in]
    assert torch.equal(flat[:21], weight) and not flat[21:].any()
