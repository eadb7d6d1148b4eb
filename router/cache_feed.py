"""Feeding replicas' numbered prefix-cache events into a ``PrefixIndex``. Pure Python, no Ray.

Each replica reports a window of events (``RoutingStats``): every change to
its prefix cache numbered from ``cache_events_from`` on, compacted to each
hash's latest. The feed applies each event once, in order. A report it has
already applied costs one comparison; a new one costs only its unseen
events. When a window starts past the next event the feed expects, events
were dropped before it read them: the replica's entries may be stale, so
they are forgotten and rebuilt from what follows.
"""

from __future__ import annotations

import bisect
import logging
from typing import Iterable

from router.prefix_index import PrefixIndex
from router.protocol import RoutingStats

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
        latest: dict[bytes, bool] = {}  # each hash's last state, so store-then-evict ends evicted
        for event in events[start:]:
            latest.pop(event.block_hash, None)
            latest[event.block_hash] = event.stored
        evicted = [h for h, stored in latest.items() if not stored]
        if evicted:
            self.index.evict(replica_id, evicted)
        stored = [h for h, stored in latest.items() if stored]
        if stored:
            self.index.insert(replica_id, stored)
        self._seen[replica_id] = last

    def retain(self, live_replica_ids: Iterable[str]) -> list[str]:
        """Forget replicas that left; returns their ids."""
        live = set(live_replica_ids)
        gone = [replica_id for replica_id in self._seen if replica_id not in live]
        for replica_id in gone:
            del self._seen[replica_id]
            self.index.remove_replica(replica_id)
        return gone
