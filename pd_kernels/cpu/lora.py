"""The multi-LoRA delta on CPU: ``lora.cpp`` for fp32, the reference for bf16 and fp16.

``lora.cpp`` groups the batch's adapter rows by slot in one pass (rows without an adapter cost only that
pass), then runs the shrink with each A row read once per group of rows of its slot, and the expand with
each thread owning a range of output columns. bf16 and fp16 take the torch reference (one product pair per
slot present, fp32 inside), as the other cpu ops do.
"""

from __future__ import annotations

import torch

from pd_kernels import reference


def lora_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    slice_starts: tuple[int, ...],
) -> None:
    """The cpu twin of ``pd_kernels.reference.lora_delta``: fp32 CPU tensors in C++, other dtypes on the
    reference."""
    if out.dtype != torch.float32 or not out.is_cpu:
        return reference.lora_delta(out, x, lora_a, lora_b, row_slots, slice_starts)
    import pd_kernels.cpu  # the package imports this module: its build() is looked up at call time

    pd_kernels.cpu.build().lora_delta_rows(out, x, lora_a, lora_b, row_slots, list(slice_starts))
