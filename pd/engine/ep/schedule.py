"""When the expert-parallel ranks sync their loads and which layer moves before each step: the driver's.

A round (every ``interval_steps`` steps, or when ``request`` asks) syncs the
loads once, then moves the MoE layers one after another, a part of one layer
before each step (``again`` keeps a layer whose move is not done), so no step
waits for more than one part of one layer's move. Between rounds the loads
are synced every ``load_sync_steps`` steps, or at the next step when
``request_sync`` asks, for the statistics. Pure: the simulator can run it.
"""

from __future__ import annotations

# Every this many steps the driver has the ranks add up their expert loads, for the metrics.
LOAD_SYNC_STEPS = 64


class EplbSchedule:
    """The ops before each step (see the module)."""

    def __init__(self, moe_layers: list[int], interval_steps: int, load_sync_steps: int = LOAD_SYNC_STEPS):
        self.moe_layers = moe_layers
        self.interval_steps = interval_steps
        self.load_sync_steps = load_sync_steps
        self.steps = 0
        self._since_round = 0
        self._pending: list[int] = []
        self._requested = False
        self._sync_requested = False

    def request(self) -> None:
        """Rebalance at the next step (every layer, one a step)."""
        self._requested = True

    def request_sync(self) -> None:
        """Sync the loads at the next step (fresh statistics)."""
        self._sync_requested = True

    @property
    def in_round(self) -> bool:
        """Whether the next step runs a part of a round (asked for, or under way)."""
        return bool(self._pending) or self._requested

    def again(self, layer: int) -> None:
        """``layer``'s move went only part of the way: it goes on before the next step."""
        self._pending.insert(0, layer)

    def next_op(self) -> tuple[bool, int | None]:
        """``(sync the loads, the layer to move)`` before this step; ``(False, None)`` for nothing."""
        self.steps += 1
        self._since_round += 1
        if not self._pending and (self._requested or 0 < self.interval_steps <= self._since_round):
            self._requested = False
            self._since_round = 0
            self._pending = list(self.moe_layers)
            return True, self._pending.pop(0)
        if self._pending:
            return False, self._pending.pop(0)
        sync, self._sync_requested = self._sync_requested or self.steps % self.load_sync_steps == 0, False
        return sync, None
