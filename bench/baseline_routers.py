"""The baseline routers of ``bench.router`` and the interface every router under test implements."""

from __future__ import annotations

import random
from typing import Any, Protocol

from bench.replica_model import PoolView
from bench.trace import TraceRequest
from router.protocol import RoutingStats


class Router(Protocol):
    """One routing policy under test. ``prepare`` is the caller's share of the work (hashing,
    gathering loads) and is not timed; ``route`` is the decision plus the router's bookkeeping."""

    def prepare(self, request: TraceRequest, pool: PoolView) -> Any: ...

    def route(self, prepared: Any, pool: PoolView) -> int: ...

    def report(self, replica: int, stats: RoutingStats) -> None:
        """The replica's latest published stats (its prefix-cache event window)."""


class RoundRobin:
    """Replicas in turn; blind to caches and queues."""

    def __init__(self, num_replicas: int) -> None:
        self._num_replicas = num_replicas
        self._next = 0

    def prepare(self, request: TraceRequest, pool: PoolView) -> None:
        return None

    def route(self, prepared: None, pool: PoolView) -> int:
        replica = self._next
        self._next = (self._next + 1) % self._num_replicas
        return replica

    def report(self, replica: int, stats: RoutingStats) -> None:
        pass


class PowerOfTwo(RoundRobin):
    """Ray Serve's default: two distinct random replicas, the shorter queue (the first on a tie)."""

    def __init__(self, num_replicas: int, seed: int) -> None:
        super().__init__(num_replicas)
        self._rng = random.Random(seed)

    def route(self, prepared: None, pool: PoolView) -> int:
        if self._num_replicas == 1:
            return 0
        first, second = self._rng.sample(range(self._num_replicas), 2)
        return second if pool.queue_len(second) < pool.queue_len(first) else first


def replica_name(replica: int) -> str:
    """The replica id a name-keyed policy sees for replica index ``replica``."""
    return f"replica-{replica}"
