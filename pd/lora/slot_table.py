"""Which adapter each of ``max_loras`` slots holds, and which slot a step's adapters take: pure Python, so that
the simulator runs the same policy as the engine (``pd.lora.slots`` moves the weights).

A step's adapters keep the slots they hold; each other one takes a free slot,
else the least recently used slot no adapter of the step holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class SlotTable:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.held: list[Hashable | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._steps = 0
        self.num_loads = 0

    def assign(self, keys: Iterable[Hashable]) -> tuple[dict[Hashable, int], list[tuple[Hashable, int]]]:
        """Each of a step's adapters' slot, and the ``(adapter, slot)`` loads that takes. ``RuntimeError`` for
        more adapters than slots (the scheduler admits at most ``max_loras`` at once)."""
        wanted = list(dict.fromkeys(keys))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters, more than max_loras {self.max_loras}")
        self._steps += 1
        slot_of = {key: slot for slot, key in enumerate(self.held) if key in wanted}
        free = sorted((slot for slot, key in enumerate(self.held) if key not in slot_of),
                      key=lambda slot: (self.held[slot] is not None, self._last_used[slot]))
        loads = []
        for key in wanted:
            if key not in slot_of:
                slot = slot_of[key] = free.pop(0)
                self.held[slot] = key
                loads.append((key, slot))
        for slot in slot_of.values():
            self._last_used[slot] = self._steps
        self.num_loads += len(loads)
        return slot_of, loads

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s slot: it is loaded again before any use."""
        for slot, held in enumerate(self.held):
            if held == key:
                self.held[slot] = None
