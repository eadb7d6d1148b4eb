"""Dense layers: the oneDNN path pads rows to a bounded set of shapes and still computes x @ W^T + b."""

from __future__ import annotations

import pytest
import torch

from pd.model.linear import EXACT_ROWS, make_linear, padded_rows


def test_padded_rows_bounds_the_shapes_and_the_waste():
    sizes = {padded_rows(n) for n in range(1, 4097)}
    assert len(sizes) <= EXACT_ROWS + 8 * 6
    for n in range(1, 4097):
        assert n <= padded_rows(n) <= max(n, n * 9 // 8 + 1)
    assert [padded_rows(n) for n in (64, 65, 129, 2049)] == [64, 72, 144, 2304]


@pytest.mark.parametrize("num_rows", [1, 7, 64, 65, 130, 300])
def test_linear_matches_the_dense_product(num_rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(num_rows, 40)
    expected = x.double() @ weight.double().t() + bias.double()
    got = make_linear(weight, bias)(x)
    assert got.shape == (num_rows, 96)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
