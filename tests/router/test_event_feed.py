"""The router's feed of replicas' prefix-cache events into its index (no Serve needed)."""

from __future__ import annotations

from types import SimpleNamespace

from router.prefix_index import PrefixIndex
from router.serve import _CacheEventFeed

A, B, C = b"a" * 8, b"b" * 8, b"c" * 8


def replica(replica_id: str, events: list[tuple[int, bytes, bool]], first_seq: int = 0) -> SimpleNamespace:
    """What the feed reads of a Serve ``RunningReplica``."""
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=replica_id),
                           routing_stats={"cache_events": events, "cache_events_from": first_seq})


def held(index: PrefixIndex, replica_id: str) -> set[bytes]:
    return {h for h in (A, B, C) if (h, replica_id) in index}


def test_a_block_stored_then_evicted_in_one_report_is_not_held():
    index = PrefixIndex(100)
    feed = _CacheEventFeed(index)
    feed.update([replica("r1", [(0, A, True), (1, B, True), (2, A, False)])])
    assert held(index, "r1") == {B}
    feed.update([replica("r1", [(3, A, True), (4, B, False)])])  # evicted then stored again
    assert held(index, "r1") == {A}


def test_each_event_is_applied_once():
    index = PrefixIndex(100)
    feed = _CacheEventFeed(index)
    feed.update([replica("r1", [(0, A, True)])])
    index.evict("r1", [A])  # as if a newer report had said so
    feed.update([replica("r1", [(0, A, True), (1, B, True)])])  # the old store is re-sent
    assert held(index, "r1") == {B}


def test_dropped_events_make_the_replicas_entries_rebuild():
    index = PrefixIndex(100)
    feed = _CacheEventFeed(index)
    feed.update([replica("r1", [(0, A, True), (1, B, True)]), replica("r2", [(0, A, True)])])
    # r1 reports from seq 5: events 2..4 (perhaps B's eviction) are gone.
    feed.update([replica("r1", [(5, C, True)], first_seq=5), replica("r2", [(0, A, True)])])
    assert held(index, "r1") == {C} and held(index, "r2") == {A}
    assert feed.num_gaps == 1
    # A window that still reaches back to the next expected event is no gap.
    feed.update([replica("r1", [(6, A, True)], first_seq=6), replica("r2", [(1, B, True)], first_seq=1)])
    assert feed.num_gaps == 1 and held(index, "r1") == {A, C} and held(index, "r2") == {A, B}


def test_a_replica_that_left_is_forgotten():
    index = PrefixIndex(100)
    feed = _CacheEventFeed(index)
    feed.update([replica("r1", [(0, A, True)]), replica("r2", [(0, B, True)])])
    feed.update([replica("r2", [(0, B, True)])])
    assert held(index, "r1") == set() and held(index, "r2") == {B}
