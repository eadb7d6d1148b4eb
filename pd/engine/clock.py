"""Where the engine reads the time: the system's clocks, or a simulator's.

Only what decides reads it (lease expiry, pull deadlines); metrics keep
reading ``time.monotonic`` directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Clock:
    """``wall``: Unix seconds, comparable across processes (a lease's expiry travels in a ``KVHandle``).
    ``monotonic``: seconds for local deadlines."""

    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic


SYSTEM_CLOCK = Clock()
