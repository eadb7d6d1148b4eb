"""The torch reference of the multi-LoRA delta (``pd_kernels.lora_delta``), re-exported by ``pd_kernels.reference``.

Many adapters serve in one batch: the base layer ran once for every row, and each row with an adapter adds
its own adapter's low-rank delta. Slot ``s`` holds one adapter's matrices for a layer whose output is
``num_slices`` column ranges (a fused q|k|v projection: 3, gate|up: 2, an unfused layer: 1)::

    lora_a[s]  [num_slices * rank, in_features]     slice i's A is rows i*rank .. (i+1)*rank - 1
    lora_b[s]  [out_features, rank]                 the scaling (alpha / rank) folded in

    t       = lora_a[s] @ x[n]                                      [num_slices * rank], fp32
    out[n, o] += lora_b[s, o] . t[i*rank : (i+1)*rank]             o in slice i: slice_starts[i] <= o < the next

``t`` is accumulated in fp32 and never rounded to the activations' dtype; the delta is added in fp32 and
rounded once. Rows are grouped by slot here, one product pair per slot present in the batch.
"""

from __future__ import annotations

import torch

from pd_kernels.checks import NO_LORA


def lora_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    slice_starts: tuple[int, ...],
) -> None:
    """Reference of ``pd_kernels.lora_delta``: adds each adapter row's delta into ``out`` in place."""
    rank = lora_b.shape[2]
    slice_ends = (*slice_starts[1:], out.shape[1])
    slots = row_slots.long()
    for slot in torch.unique(slots).tolist():
        if slot == NO_LORA:
            continue
        rows = torch.nonzero(slots == slot).squeeze(1)  # this slot's rows, in batch order
        shrunk = x[rows].float() @ lora_a[slot].float().t()  # [rows, num_slices * rank]
        delta = torch.empty(rows.numel(), out.shape[1], dtype=torch.float32, device=out.device)
        for i, (start, end) in enumerate(zip(slice_starts, slice_ends)):
            # [rows, rank] @ [rank, end - start]
            delta[:, start:end] = shrunk[:, i * rank:(i + 1) * rank] @ lora_b[slot, start:end].float().t()
        out[rows] = (out[rows].float() + delta).to(out.dtype)
