"""oneDNN's GEMM as the model's dense layers (``pd.model.linear``) and the CPU fused MoE's expert GEMMs
(``pd_kernels.cpu.moe``) both call it: the op, whether it runs bf16 here, and the row counts it runs with
(bucketed, so the kernels oneDNN builds and keeps stay few).
"""

from __future__ import annotations

import functools

import torch

# The op's overload itself: calling the packet resolves among its overloads on every call (about 8 us).
linear_pointwise = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


@functools.cache
def bf16_supported() -> bool:
    """Whether oneDNN has a native bf16 path on this host (fixed for the process: read once)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
