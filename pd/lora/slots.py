"""The adapters a step may use, on the device: ``max_loras`` slots per layer and projection.

Each slot of a projection holds one adapter's A and B padded to
``max_lora_rank`` with zeros (``pd.model.lora.LoraBuffers``); a projection the
adapter does not adapt stays zero, and adds nothing. Before a step, ``assign``
gives each adapter of the step a slot, loading the ones not held into the
least recently used slots no row of the step needs: between steps, never
inside one.

Under tensor parallelism a rank holds its shard of each adapter as it holds
the base layer's: a column-parallel projection (q, k, v, gate, up) its rows of
B, a row-parallel one (o, down) its columns of A. The row-parallel delta is then
a partial sum, reduced with the base layer's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from pd.lora import AdapterId
from pd.lora.adapter import LoraAdapter
from pd.lora.slot_table import SlotTable
from pd.model.config import ModelConfig
from pd.model.lora import DOWN, GATE_UP, PROJECTION_MODULES, QKV, LoraBuffers, O
from pd.model.tp import SINGLE, TPShard

logger = logging.getLogger(__name__)


def _shapes(config: ModelConfig, shard: TPShard, layer: int) -> dict[str, tuple[int, list[tuple[int, int]], str]]:
    """Per projection of ``layer``: its input features on this rank, each slice's rows of the full output
    (``(start, stop)``), and which of A's columns (``"in"``) or B's rows (``"out"``) the rank holds."""
    hd = config.head_dim
    heads, kv_heads = shard.heads(config), shard.kv_heads(config)
    q_rows, kv_rows = (heads[0] * hd, heads[1] * hd), (kv_heads[0] * hd, kv_heads[1] * hd)
    q_local = q_rows[1] - q_rows[0]
    shapes = {QKV: (config.hidden_size, [q_rows, kv_rows, kv_rows], "out"),
              O: (q_local, [(0, config.hidden_size)], "in")}
    if not config.is_moe_layer(layer):
        inter = shard.intermediate(config)
        shapes[GATE_UP] = (config.hidden_size, [inter, inter], "out")
        shapes[DOWN] = (inter[1] - inter[0], [(0, config.hidden_size)], "in")
    return shapes


class LoraSlots:
    """``max_loras`` slots of every adapted projection of the rank ``shard`` of ``config``'s model."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, shard: TPShard = SINGLE):
        self.config, self.shard = config, shard
        self.max_loras, self.max_rank = max_loras, max_rank
        self._columns: list[dict[str, tuple[int, int] | None]] = []  # per layer, projection: A's columns held
        self._rows: list[dict[str, list[tuple[int, int]]]] = []  # per layer, projection: each slice's B rows
        self.layers: list[dict[str, LoraBuffers]] = []
        for layer in range(config.num_layers):
            buffers, columns, rows = {}, {}, {}
            for projection, (in_features, slices, held) in _shapes(config, shard, layer).items():
                sizes = [stop - start for start, stop in slices]
                starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))
                buffers[projection] = LoraBuffers(
                    a=torch.zeros(max_loras, len(slices) * max_rank, in_features, dtype=dtype, device=device),
                    b=torch.zeros(max_loras, sum(sizes), max_rank, dtype=dtype, device=device),
                    slice_starts=starts)
                columns[projection] = None if held == "out" else self._in_range(projection, layer)
                rows[projection] = slices
            self.layers.append(buffers)
            self._columns.append(columns)
            self._rows.append(rows)
        self.table = SlotTable(max_loras)  # which adapter each slot holds (pure Python; the simulator's too)
        self.num_bytes = sum(b.a.nbytes + b.b.nbytes for layer in self.layers for b in layer.values())

    @property
    def num_slot_loads(self) -> int:
        return self.table.num_loads

    def _in_range(self, projection: str, layer: int) -> tuple[int, int] | None:
        """The columns of A (the input features) a rank holds of a row-parallel projection."""
        if self.shard.size == 1:
            return None
        if projection == O:
            start, stop = self.shard.heads(self.config)
            return start * self.config.head_dim, stop * self.config.head_dim
        return self.shard.intermediate(self.config)

    def assign(self, adapters: Iterable[tuple[AdapterId, LoraAdapter]],
               on_load: Callable[[int, AdapterId], None] | None = None) -> dict[AdapterId, int]:
        """A slot for each of a step's adapters, loading those not held (``SlotTable.assign``); ``on_load(slot,
        key)`` is told of each load (the tensor-parallel driver tells its workers to load their shards)."""
        weights = dict(adapters)
        slot_of, loads = self.table.assign(weights)
        for key, slot in loads:
            self.load(slot, weights[key])
            if on_load is not None:
                on_load(slot, key)
        return slot_of

    @torch.inference_mode()
    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy this rank's shard of ``adapter`` into ``slot`` (zeros where it adapts nothing)."""
        r = self.max_rank
        for layer, buffers in enumerate(self.layers):
            for projection, buf in buffers.items():
                buf.a[slot].zero_()
                buf.b[slot].zero_()
                columns = self._columns[layer][projection]
                for index, (module, rows) in enumerate(zip(PROJECTION_MODULES[projection],
                                                           self._rows[layer][projection])):
                    weights = adapter.modules.get((layer, module))
                    if weights is None:
                        continue
                    rank = weights.a.shape[0]
                    a = weights.a if columns is None else weights.a[:, columns[0]:columns[1]]
                    start = buf.slice_starts[index]
                    b = weights.b[rows[0]:rows[1]]
                    buf.a[slot, index * r:index * r + rank].copy_(a)
                    buf.b[slot, start:start + b.shape[0], :rank].copy_(b)
        logger.debug("LoRA adapter %s loaded into slot %d", adapter.name, slot)
