"""Simulated time: a heap of events, run in time order, ties in the order they were scheduled."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable



class EventLoop:
    """Deterministic: the same events scheduled in the same order run in the same order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def time(self) -> float:
        """The simulated time, for what reads a clock."""
        return self.now

    def at(self, time_s: float, action: Callable[[], None]) -> None:
        """Run ``action`` at ``time_s`` (never before now)."""
        heapq.heappush(self._events, (max(time_s, self.now), next(self._order), action))

    def has_events(self) -> bool:
        return bool(self._events)

    def run(self) -> None:
        """Run events until none is left."""
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
