"""The Triton FP8 scaled product against its torch reference (in the interpreter on CPU), and the FP8 layer."""

from __future__ import annotations

import pytest
import torch

from pd.model.quant_linear import Fp8Linear
from pd.model.quant_scheme import WeightFormat
from pd.model.quant_weights import dequantize, per_row, quantize
from pd_kernels.triton.scaled_mm import FP8, GROUP_K, quantize_fp8_rows, scaled_mm, scaled_mm_reference

# Odd sizes: rows past one tile, K past one 128-column group and not a multiple of BLOCK_K, N ragged.
SHAPES = [(1, 64, 40), (19, 200, 72), (33, 384, 130)]


def _operands(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_per_token_per_channel_product_equals_the_reference(m, k, n, out_dtype):
    x, weight, bias = _operands(m, k, n, seed=m)
    q = quantize(weight, WeightFormat.FP8_CHANNEL)
    a, a_scale = quantize_fp8_rows(x)
    for b in (None, bias):
        got = scaled_mm(a, q.weight, a_scale, q.scale, None, b, out_dtype)
        want = scaled_mm_reference(a, q.weight, a_scale, q.scale, None, b, out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        tol = 1e-5 if out_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    exact = x @ weight.t()
    assert (got.float() - bias - exact).norm() / exact.norm() < 0.1  # FP8 operands: ~3% each


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("scale_rows", [GROUP_K, 1])
def test_block_scaled_product_equals_the_reference(m, k, n, scale_rows):
    x, weight, bias = _operands(m, k, n, seed=n)
    q = quantize(weight, WeightFormat.FP8_BLOCK)
    if scale_rows == 1:
        q = per_row(q)
    a, a_scale = quantize_fp8_rows(x, GROUP_K)
    assert a_scale.shape == (m, -(-k // GROUP_K))
    got = scaled_mm(a, q.weight, a_scale, q.scale, scale_rows, bias, torch.float32)
    torch.testing.assert_close(got, scaled_mm_reference(a, q.weight, a_scale, q.scale, scale_rows, bias,
                                                        torch.float32), atol=1e-5, rtol=1e-5)


def test_fp8_rows_dequantize_within_e4m3_rounding():
    x = torch.randn(9, 300)
    x[3, 7] = 80.0  # an outlier costs its own row's (and group's) precision only
    for group in (None, GROUP_K):
        q, scale = quantize_fp8_rows(x, group)
        full = scale[:, None] if group is None else scale.repeat_interleave(GROUP_K, dim=1)[:, :300]
        error = (q.float() * full - x).abs()
        assert torch.all(error <= torch.maximum(x.abs() * 2.0**-4, full * 2.0**-6) * (1 + 1e-5))


def test_the_fp8_layer_computes_the_dequantized_product():
    x, weight, bias = _operands(17, 256, 96, seed=1)
    for weight_format, block_rows in ((WeightFormat.FP8_CHANNEL, None), (WeightFormat.FP8_BLOCK, 128)):
        q = quantize(weight, weight_format)
        layer = Fp8Linear(q.weight, q.scale, block_rows, bias)
        exact = x @ dequantize(q).t() + bias
        assert (layer(x) - exact).norm() / (exact - bias).norm() < 0.05  # the activations' FP8 rounding


def test_bad_arguments_are_refused_by_name():
    a, a_scale = quantize_fp8_rows(torch.randn(4, 64))
    b = torch.zeros(8, 64, dtype=FP8)
    with pytest.raises(ValueError, match="b: expected a 2-D"):
        scaled_mm(a, b.float(), a_scale, torch.ones(8))
    with pytest.raises(ValueError, match="b: in_features 32"):
        scaled_mm(a, b[:, :32], a_scale, torch.ones(8))
    with pytest.raises(ValueError, match="a_scale: per-token"):
        scaled_mm(a, b, a_scale[:2], torch.ones(8))
    with pytest.raises(ValueError, match="b_scale: block scales"):
        scaled_mm(a, b, torch.ones(4, 1), torch.ones(8, 1), scale_rows=GROUP_K)
    with pytest.raises(ValueError, match="scale_rows: must be 1 or 128"):
        scaled_mm(a, b, torch.ones(4, 1), torch.ones(1, 1), scale_rows=64)
