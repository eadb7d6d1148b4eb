"""The ``cpu`` backend's int8 GEMM (``cpu/int8_gemm.cpp``): exact int32 products, and where W8A8 layers take it."""

from __future__ import annotations

import pytest
import torch

import pd_kernels.cpu
import pd_kernels.int8
from pd.model.quant_weights import WeightFormat, quantize
from pd_kernels.int8 import int8_linear, int8_linear_reference


def exact(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (xq.long() @ w.long().t()).int()


def int8s(*shape: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8)


# K: all of it in the scalar tail (15), whole 16-steps, and both; N: groups of 4 out features and every
# remainder; M: pairs of rows and an odd one out.
@pytest.mark.parametrize("in_features", [15, 16, 200, 1537])
@pytest.mark.parametrize("out_features", [1, 2, 3, 4, 5, 7, 72])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 17])
def test_equals_the_exact_product(num_rows, out_features, in_features):
    torch.manual_seed(num_rows * 1000 + out_features * 10 + in_features)
    xq, w = int8s(num_rows, in_features), int8s(out_features, in_features)
    got = pd_kernels.cpu.build().int8_gemm(xq, w)
    assert got.dtype == torch.int32 and got.shape == (num_rows, out_features)
    assert torch.equal(got, exact(xq, w))


def test_the_extremes_add_up_without_overflow():
    """Every product at +-127 * 127 over 8,192 inputs: 132 million, in int32 as in the exact sum."""
    xq = torch.full((3, 8192), -127, dtype=torch.int8)
    w = torch.full((5, 8192), 127, dtype=torch.int8)
    w[1] = -127
    got = pd_kernels.cpu.build().int8_gemm(xq, w)
    assert torch.equal(got, exact(xq, w)) and got[0, 0] == -127 * 127 * 8192


def test_bad_operands_are_named():
    gemm = pd_kernels.cpu.build().int8_gemm
    with pytest.raises(RuntimeError, match="w: expected int8"):
        gemm(int8s(2, 8), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="w: in_features 9 differs from xq's 8"):
        gemm(int8s(2, 8), int8s(3, 9))
    with pytest.raises(RuntimeError, match="xq: must be contiguous"):
        gemm(int8s(8, 2).t(), int8s(3, 8))


class Spy:
    """The extension, counting its int8_gemm calls."""

    def __init__(self, extension):
        self._extension = extension
        self.gemm_calls = 0

    def int8_gemm(self, xq, w):
        self.gemm_calls += 1
        return self._extension.int8_gemm(xq, w)

    def __getattr__(self, name):
        return getattr(self._extension, name)


@pytest.mark.parametrize("onednn", [False, True])
def test_a_layer_takes_it_where_torch_int_mm_has_no_onednn_path(monkeypatch, onednn):
    monkeypatch.setattr(pd_kernels.int8, "onednn_int8", lambda: onednn)
    torch.manual_seed(0)
    x, weight, bias = torch.randn(9, 200), torch.randn(72, 200) * 0.05, torch.randn(72)
    q = quantize(weight, WeightFormat.INT8_CHANNEL)
    spy = Spy(pd_kernels.cpu.build())
    for rows in (x, x.bfloat16()):  # the fused loops around the GEMM, and the aten chain
        got = int8_linear(rows, q.weight, q.scale, bias, spy)
        torch.testing.assert_close(got, int8_linear_reference(rows, q.weight, q.scale, bias), atol=1e-5, rtol=1e-5)
    assert spy.gemm_calls == (0 if onednn else 2)


def test_equals_torch_int_mm():
    torch.manual_seed(1)
    xq, w = int8s(33, 300), int8s(50, 300)
    assert torch.equal(pd_kernels.cpu.build().int8_gemm(xq, w), torch._int_mm(xq, w.t()))


def test_onednn_s_int8_path_is_read_from_the_host_s_flags():
    from pd.workload.host import cpu_flags

    assert pd_kernels.int8.onednn_int8() == ("avx512_vnni" in cpu_flags())
