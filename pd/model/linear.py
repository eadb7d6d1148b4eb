"""Dense layers, stored in whichever form the device multiplies fastest.

On CPU, weights are pre-packed once for oneDNN. On this project's x86 test
machines its fp32 GEMM runs 2-3x faster than the default BLAS path of
``F.linear`` at every batch size (the default BLAS takes a slow generic code
path on some vendors' CPUs), with fp32 accumulation throughout. Elsewhere, or
where oneDNN is missing, the weight is kept transposed, ``[in, out]``, for a
plain matmul.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# The op's overload itself: calling the packet resolves among its overloads on every call (about 8 us).
_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in ONEDNN_DTYPES and torch.backends.mkldnn.is_available()


# Row counts up to this many run as they are; above it they are rounded up.
EXACT_ROWS = 64
# Rounded row counts per doubling: at most 1/8 of the rows are padding.
BUCKETS_PER_OCTAVE = 8


def padded_rows(num_rows: int) -> int:
    """The row count a oneDNN GEMM runs with.

    oneDNN builds and keeps a kernel per input shape, so prefill chunks of
    every length made a replica's resident memory grow without bound (72% in
    five minutes of a soak). Rounding up to one of 8 sizes per doubling bounds
    the distinct shapes to ``EXACT_ROWS + 8 * log2(rows / EXACT_ROWS)``:

        65..72 -> 72,  129..144 -> 144,  2049..2304 -> 2304
    """
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 1 - BUCKETS_PER_OCTAVE.bit_length() + 1)
    return -(-num_rows // step) * step


@dataclass(frozen=True)
class Linear:
    """``y = x @ W^T + b`` for ``x [num_tokens, in_features]``."""

    weight: torch.Tensor  # oneDNN-packed [out, in] when ``packed``, else dense [in, out]
    bias: torch.Tensor | None  # [out]
    packed: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            num_rows = x.shape[0]
            bucket = padded_rows(num_rows)
            if bucket != num_rows:
                padded = x.new_zeros(bucket, x.shape[1])
                padded[:num_rows] = x
                return _linear_pointwise(padded, self.weight, self.bias, "none", [], "")[:num_rows]
            return _linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return torch.matmul(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """Build from an HF-layout ``[out, in]`` weight already on its device and dtype."""
    if onednn_available(weight.device, weight.dtype):
        return Linear(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()), bias, packed=True)
    return Linear(weight.t().contiguous(), bias, packed=False)
