"""Simulated time: a heap of events, run in time order, ties in the order they were scheduled."""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from typing import Callable, Iterator

# The youngest generation's threshold while a loop runs (Python's default is 700): a step allocates
# a few dozen objects, and most of them die before the next collection either way.
RUN_GC_THRESHOLD = 20_000


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
        events = self._events
        with _quiet_gc():
            while events:
                self.now, _, action = heapq.heappop(events)
                action()


@contextlib.contextmanager
def _quiet_gc() -> Iterator[None]:
    """What exists when the loop starts (a fleet of engines, the trace) is not scanned by the cyclic GC while
    it runs, and young objects are collected less often. A full collection scanned every engine's block
    pool over and over: a quarter of the wall time of 1,000 replicas. Both are undone when the loop ends."""
    threshold = gc.get_threshold()
    freezes = gc.get_freeze_count() == 0  # never unfreeze what another part of the process froze
    if freezes:
        gc.freeze()
    gc.set_threshold(RUN_GC_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freezes:
            gc.unfreeze()
