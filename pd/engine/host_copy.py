"""A step's host lists copied to the device in one transfer."""

from __future__ import annotations

import itertools

import numpy as np
import torch


def copy_to_device(int64_lists: list[list[int]], int32_lists: list[list[int]],
                   device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy host lists to ``device`` in one transfer; returns a contiguous 1-D tensor per list.

    The lists go back to back into one int64 host buffer, pinned when the
    device is CUDA so that the copy is asynchronous; the int32 ones are then
    narrowed on the device in one conversion:

        host:    | int64_lists[0] | int64_lists[1] | .. | int32_lists[0] | int32_lists[1] | .. |
        device:  |<----------- int64 views ---------->|<------ one int32 copy, views ------>|
    """
    int64_sizes = [len(values) for values in int64_lists]
    int32_sizes = [len(values) for values in int32_lists]
    # numpy converts a Python int sequence several times faster than torch.tensor does.
    flat = np.fromiter(itertools.chain(*int64_lists, *int32_lists), dtype=np.int64,
                       count=sum(int64_sizes) + sum(int32_sizes))
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)  # the host buffer itself when the device is the CPU
    num_int64 = sum(int64_sizes)
    int64_views = on_device[:num_int64].split(int64_sizes)
    int32_views = on_device[num_int64:].to(torch.int32).split(int32_sizes)
    return list(int64_views), list(int32_views)


def copy_floats_to_device(float_lists: list[list[float]], device: torch.device) -> list[torch.Tensor]:
    """``copy_to_device`` for lists of floats: fp32, one transfer, a contiguous 1-D tensor per list."""
    host = torch.tensor(list(itertools.chain(*float_lists)), dtype=torch.float32)
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(values) for values in float_lists]))
