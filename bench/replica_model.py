"""The modelled replica pool of ``bench.router``: per-replica prefix caches and FIFO queues.

Each replica holds an LRU cache of trace block ids and serves one request at a
time; ``PoolView`` is what a router under test may see when a request arrives.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

from pd.engine.block_pool import CacheEventLog
from router.protocol import RoutingStats


def block_key(hash_id: int) -> bytes:
    """A trace block id as the 8-byte hash the index keys on."""
    return hash_id.to_bytes(8, "big", signed=True)


class ReplicaCache:
    """An LRU prefix cache of block ids that numbers what it stores and evicts, as an engine does."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._events = CacheEventLog()

    def report(self) -> RoutingStats:
        """What the replica publishes: its event window, as ``record_routing_stats`` does."""
        return RoutingStats.of(*self._events.window())

    def match(self, hash_ids: Sequence[int]) -> int:
        """The leading run of ``hash_ids`` held."""
        for position, block_id in enumerate(hash_ids):
            if block_id not in self._blocks:
                return position
        return len(hash_ids)

    def insert(self, hash_ids: Sequence[int]) -> None:
        # Last block first, so the prompt's head is the most recently used.
        for block_id in reversed(hash_ids):
            if block_id in self._blocks:
                self._blocks.move_to_end(block_id)
            else:
                self._blocks[block_id] = None
                self._events.record(block_key(block_id), stored=True)
        while len(self._blocks) > self.capacity_blocks:
            evicted, _ = self._blocks.popitem(last=False)
            self._events.record(block_key(evicted), stored=False)


@dataclass
class _Job:
    start_s: float
    prefill_end_s: float
    finish_s: float
    uncached_tokens: int
    num_blocks: int


class ReplicaQueue:
    """One FIFO single-server replica."""

    def __init__(self) -> None:
        self.jobs: deque[_Job] = deque()
        self.free_at_s = 0.0
        self.num_routed = 0

    def retire(self, now_s: float) -> None:
        while self.jobs and self.jobs[0].finish_s <= now_s:
            self.jobs.popleft()

    def queued_prefill_tokens(self, now_s: float) -> int:
        return sum(job.uncached_tokens for job in self.jobs if job.prefill_end_s > now_s)

    def kv_usage(self, now_s: float, cache_blocks: int) -> float:
        """The running request's blocks over the cache size; waiting requests hold no KV yet."""
        if not self.jobs or self.jobs[0].start_s > now_s:
            return 0.0
        return min(1.0, self.jobs[0].num_blocks / cache_blocks)

    def submit(self, now_s: float, prefill_s: float, decode_s: float, uncached: int, num_blocks: int) -> float:
        """Queue a request; returns its TTFT."""
        start_s = max(now_s, self.free_at_s)
        prefill_end_s = start_s + prefill_s
        self.free_at_s = prefill_end_s + decode_s
        self.jobs.append(_Job(start_s, prefill_end_s, self.free_at_s, uncached, num_blocks))
        self.num_routed += 1
        return prefill_end_s - now_s


@dataclass(frozen=True)
class PoolView:
    """What a router may see of the pool when one request arrives."""

    now_s: float
    queues: list[ReplicaQueue]
    cache_blocks: int

    def queue_len(self, replica: int) -> int:
        return len(self.queues[replica].jobs)
