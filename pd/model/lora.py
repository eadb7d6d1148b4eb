"""LoRA deltas over the dense layers, per row: what a step of many adapters adds to the base model's outputs.

The base GEMM runs once for every row of a step; each adapted layer then adds,
row by row, its adapter's ``x · Aᵀ · Bᵀ`` (the scaling folded into B) through
``pd_kernels.lora_delta``. The adapters a step may use sit in slots, a stack
of A and B per layer and projection (``LoraBuffers``, filled by
``pd.lora.slots``); the step says which slot each row takes (``LoraRows``).
A step whose rows use no adapter carries no ``LoraRows`` and costs nothing.

Fused projections keep their fusion: ``qkv`` (slices q, k, v) and
``gate_up`` (slices gate, up) take their slices' A matrices stacked and
their B matrices side by side, so one call adds all three (or two) deltas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

import pd_kernels

# The projections an adapter adapts, as the model fuses them; and which of the checkpoint's modules each holds,
# slice by slice (``pd.lora.adapter.LORA_MODULES``).
QKV, O, GATE_UP, DOWN = "qkv", "o", "gate_up", "down"
PROJECTION_MODULES: dict[str, tuple[str, ...]] = {
    QKV: ("q_proj", "k_proj", "v_proj"),
    O: ("o_proj",),
    GATE_UP: ("gate_proj", "up_proj"),
    DOWN: ("down_proj",),
}


@dataclass(frozen=True)
class LoraBuffers:
    """One projection's slots: ``a`` ``[max_loras, num_slices * max_rank, in_features]`` and ``b``
    ``[max_loras, out_features, max_rank]`` (scaling folded in); slice ``i`` is B's output columns from
    ``slice_starts[i]`` on, and A's rows ``i * max_rank`` to ``(i + 1) * max_rank``."""

    a: torch.Tensor
    b: torch.Tensor
    slice_starts: tuple[int, ...]


@dataclass(frozen=True)
class LoraRows:
    """A step's adapters: each row's slot (``pd_kernels.NO_LORA`` for a row under the base model), and every
    layer's slots, ``layers[layer][projection]`` (a layer lacks the projections it cannot adapt: an MoE
    layer's MLP)."""

    row_slots: torch.Tensor  # int32 [rows]
    layers: Sequence[Mapping[str, LoraBuffers]]

    def padded(self, rows: int) -> LoraRows:
        """These rows followed by base-model rows up to ``rows`` (the rows a batch runs as)."""
        extra = rows - self.row_slots.shape[0]
        if extra <= 0:
            return self
        pad = self.row_slots.new_full((extra,), pd_kernels.NO_LORA)
        return LoraRows(torch.cat([self.row_slots, pad]), self.layers)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str, backend: str) -> torch.Tensor:
        """``out`` (``projection``'s output for input ``x``, ``[rows, out_features]``) with each row's delta
        added in place."""
        buffers = self.layers[layer].get(projection)
        if buffers is not None:
            pd_kernels.lora_delta(out, x, buffers.a, buffers.b, self.row_slots, buffers.slice_starts,
                                  backend=backend)
        return out


def adapted(out: torch.Tensor, x: torch.Tensor, lora: LoraRows | None, layer: int, projection: str,
            backend: str) -> torch.Tensor:
    """A dense projection's output ``out`` for ``x``, plus the step's adapters' deltas where it has any."""
    return out if lora is None else lora.add(out, x, layer, projection, backend)
