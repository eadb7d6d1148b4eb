"""Host-side helpers shared by every Triton launch in this package."""

from __future__ import annotations

import functools
import os

import torch
import triton


def is_interpreted(device: torch.device) -> bool:
    """True when kernels on ``device`` run in the Triton interpreter (CPU tensors)."""
    return torch.device(device).type != "cuda"


def check_launchable(device: torch.device) -> None:
    """Fail clearly where Triton cannot run, instead of with "0 active drivers"."""
    if is_interpreted(device) and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton backend needs CUDA tensors, got {device}; on CPU set TRITON_INTERPRET=1 "
            "before anything imports triton or kernels, or use backend='torch'"
        )


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """SMs of ``device``; 0 where kernels are interpreted (nothing to fill)."""
    device = torch.device(device)
    if is_interpreted(device):
        return 0
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def row_block(num_cols_padded: int, device: torch.device) -> int:
    """Rows per program for row-wise kernels (norm, rotary, KV store).

    On a GPU a program holds about 4K elements. The interpreter pays per
    program and per operation rather than per element, so it takes tiles of
    about 64K elements.
    """
    budget = 1 << 16 if is_interpreted(device) else 1 << 12
    return max(1, budget // num_cols_padded)
