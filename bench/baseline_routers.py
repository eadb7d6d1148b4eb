"""The peers ``bench.router`` compares the app's router with, as ``sim.placement.Placement``s."""

from __future__ import annotations

import random

from router.protocol import RoutingStats
from sim.placement import Arrival, PoolView


class RoundRobin:
    """Replicas in turn; blind to caches and queues."""

    def __init__(self) -> None:
        self._next = 0

    def place(self, arrival: Arrival, pool: PoolView) -> str:
        replica_ids = pool.replica_ids
        replica_id = replica_ids[self._next % len(replica_ids)]
        self._next += 1
        return replica_id

    def report(self, replica_id: str, stats: RoutingStats) -> None:
        pass


class PowerOfTwo(RoundRobin):
    """Ray Serve's default: two distinct random replicas, the one with fewer requests in flight (the first on a tie)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def place(self, arrival: Arrival, pool: PoolView) -> str:
        replica_ids = pool.replica_ids
        if len(replica_ids) == 1:
            return replica_ids[0]
        first, second = self._rng.sample(replica_ids, 2)
        return second if pool.in_flight(second) < pool.in_flight(first) else first
