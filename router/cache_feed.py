"""Feeding replicas' numbered prefix-cache events into a ``PrefixIndex``. Pure Python, no Ray.

Each replica reports a window of events (``RoutingStats``): every change to
where it holds a block, numbered from ``cache_events_from`` on, compacted to
each ``CacheEvent.key``'s latest. The feed applies each event once, in order.
A report it has already applied costs one comparison; a new one costs only
its unseen events. When a window starts past the next event the feed
expects, events were dropped before it read them: the replica's entries may
be stale, so they are forgotten and rebuilt from what follows.

An event about the replica's own copy files the block under the replica at
its tier, or drops it. One about the deployment's shared store files it
under ``SHARED_STORE``, which counts for every replica. Replicas report the
shared store's changes in no common order: the feed applies them as they
come, and the last applied stands. A replica that leaves, or whose events
were dropped, takes its own entries with it, not the shared store's.
"""

from __future__ import annotations

import bisect
import logging
from typing import Iterable

from router.prefix_index import SHARED_STORE, PrefixIndex
from router.protocol import CacheEvent, RoutingStats
from router.tiers import Tier

logger = logging.getLogger(__name__)

_NOTHING_SEEN = -1


class CacheEventFeed:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self._seen: dict[str, int] = {}  # replica id -> the last event seq applied
        self.num_gaps = 0

    def apply(self, replica_id: str, stats: RoutingStats) -> None:
        """Apply the events of ``replica_id``'s report that this feed has not applied yet."""
        seen = self._seen.get(replica_id, _NOTHING_SEEN)
        last = stats.last_seq
        if last is None or last <= seen:
            return
        if seen != _NOTHING_SEEN and stats.cache_events_from > seen + 1:
            logger.info("replica %s: prefix-cache events %d.. were dropped; rebuilding its index entries",
                        replica_id, seen + 1)
            self.num_gaps += 1
            self.index.remove_replica(replica_id)
            seen = _NOTHING_SEEN
        events = stats.cache_events
        start = bisect.bisect_right(events, seen, key=lambda event: event.seq)
        latest: dict[tuple[bytes, bool], CacheEvent] = {}  # each key's last event: store-then-evict ends evicted
        for event in events[start:]:
            latest.pop(event.key, None)
            latest[event.key] = event
        self._apply_latest(replica_id, latest.values())
        self._seen[replica_id] = last

    def _apply_latest(self, replica_id: str, events: Iterable[CacheEvent]) -> None:
        """Evictions first, then stores, one ``insert`` per (holder, tier), each in the events' order."""
        evicted: dict[str, list[bytes]] = {}
        stored: dict[tuple[str, int], list[bytes]] = {}
        for event in events:
            holder = SHARED_STORE if event.tier == Tier.SHARED else replica_id
            if event.stored:
                stored.setdefault((holder, event.tier), []).append(event.block_hash)
            else:
                evicted.setdefault(holder, []).append(event.block_hash)
        for holder, block_hashes in evicted.items():
            self.index.evict(holder, block_hashes)
        for (holder, tier), block_hashes in stored.items():
            self.index.insert(holder, block_hashes, tier)

    def retain(self, live_replica_ids: Iterable[str]) -> list[str]:
        """Forget replicas that left; returns their ids."""
        live = set(live_replica_ids)
        gone = [replica_id for replica_id in self._seen if replica_id not in live]
        for replica_id in gone:
            del self._seen[replica_id]
            self.index.remove_replica(replica_id)
        return gone
