"""The feed of replicas' numbered prefix-cache events into an index (pure, no Serve)."""

from __future__ import annotations

from router.cache_feed import CacheEventFeed
from router.prefix_index import SHARED_STORE, PrefixIndex
from router.protocol import CacheEvent, RoutingStats
from router.tiers import Tier

A, B, C = b"a" * 8, b"b" * 8, b"c" * 8


def report(events: list[tuple], first_seq: int = 0) -> RoutingStats:
    """A replica's published stats holding these ``(seq, hash, stored)`` or ``(seq, hash, stored, tier)`` events."""
    return RoutingStats(cache_events_from=first_seq,
                        cache_events=tuple(CacheEvent(*event) for event in events))


def held(index: PrefixIndex, replica_id: str) -> set[bytes]:
    return {h for h in (A, B, C) if (h, replica_id) in index}


def test_a_block_stored_then_evicted_in_one_report_is_not_held():
    index = PrefixIndex(100)
    feed = CacheEventFeed(index)
    feed.apply("r1", report([(0, A, True), (1, B, True), (2, A, False)]))
    assert held(index, "r1") == {B}
    feed.apply("r1", report([(3, A, True), (4, B, False)]))  # evicted then stored again
    assert held(index, "r1") == {A}


def test_each_event_is_applied_once():
    index = PrefixIndex(100)
    feed = CacheEventFeed(index)
    feed.apply("r1", report([(0, A, True)]))
    index.evict("r1", [A])  # as if a newer report had said so
    feed.apply("r1", report([(0, A, True), (1, B, True)]))  # the old store is re-sent
    assert held(index, "r1") == {B}


def test_a_report_already_applied_touches_nothing():
    """Routing decisions re-read every replica's report: an old one must not walk its window again."""
    index = PrefixIndex(100)
    feed = CacheEventFeed(index)
    stats = report([(0, A, True), (1, B, True)])
    feed.apply("r1", stats)
    index.evict("r1", [A, B])
    walked = []
    original = index.insert
    index.insert = lambda *args: walked.append(args) or original(*args)
    feed.apply("r1", stats)
    assert walked == [] and held(index, "r1") == set()


def test_dropped_events_make_the_replicas_entries_rebuild():
    index = PrefixIndex(100)
    feed = CacheEventFeed(index)
    feed.apply("r1", report([(0, A, True), (1, B, True)]))
    feed.apply("r2", report([(0, A, True)]))
    # r1 reports from seq 5: events 2..4 (perhaps B's eviction) are gone.
    feed.apply("r1", report([(5, C, True)], first_seq=5))
    feed.apply("r2", report([(0, A, True)]))
    assert held(index, "r1") == {C} and held(index, "r2") == {A}
    assert feed.num_gaps == 1
    # A window that still reaches back to the next expected event is no gap.
    feed.apply("r1", report([(6, A, True)], first_seq=6))
    feed.apply("r2", report([(1, B, True)], first_seq=1))
    assert feed.num_gaps == 1 and held(index, "r1") == {A, C} and held(index, "r2") == {A, B}


def test_a_replica_that_left_is_forgotten():
    index = PrefixIndex(100)
    feed = CacheEventFeed(index)
    feed.apply("r1", report([(0, A, True)]))
    feed.apply("r2", report([(0, B, True)]))
    assert feed.retain(["r2"]) == ["r1"]
    assert held(index, "r1") == set() and held(index, "r2") == {B}


def test_a_block_moves_between_tiers_until_it_is_gone():
    index = PrefixIndex(100)
    feed = CacheEventFeed(index)
    feed.apply("r1", report([(0, A, True, Tier.DEVICE), (1, B, True, Tier.DEVICE)]))
    assert index.match_tiers([A, B]) == {"r1": (Tier.DEVICE, Tier.DEVICE)}
    feed.apply("r1", report([(2, A, True, Tier.HOST)], first_seq=2))  # demoted
    assert index.match_tiers([A, B]) == {"r1": (Tier.HOST, Tier.DEVICE)}
    feed.apply("r1", report([(3, A, True, Tier.DISK), (4, B, True, Tier.HOST)], first_seq=3))
    assert index.match_tiers([A, B]) == {"r1": (Tier.DISK, Tier.HOST)}
    feed.apply("r1", report([(5, A, False, Tier.DISK)], first_seq=5))  # held nowhere now
    assert index.tier(A, "r1") is None and index.match_tiers([A, B]) == {}
    # Moved and then promoted within one window: the latest tier stands.
    feed.apply("r1", report([(6, A, True, Tier.HOST), (7, A, True, Tier.DEVICE)], first_seq=6))
    assert index.match_tiers([A, B]) == {"r1": (Tier.DEVICE, Tier.HOST)}


def test_shared_store_events_make_a_prefix_count_on_every_replica():
    index = PrefixIndex(100)
    feed = CacheEventFeed(index)
    feed.apply("r1", report([(0, A, True, Tier.DEVICE), (1, A, True, Tier.SHARED), (2, B, True, Tier.SHARED)]))
    feed.apply("r2", report([(0, C, True, Tier.DEVICE)]))
    assert index.match_tiers([A, B, C], ["r1", "r2", "r3"]) == {
        "r1": (Tier.DEVICE, Tier.SHARED), "r2": (Tier.SHARED, Tier.SHARED, Tier.DEVICE), "r3": (Tier.SHARED, Tier.SHARED)}
    # A hash's own and shared states are apart: r1 dropping its own copy leaves the shared one.
    feed.apply("r1", report([(3, A, False, Tier.DEVICE)], first_seq=3))
    assert index.match_tiers([A, B], ["r1"]) == {"r1": (Tier.SHARED, Tier.SHARED)}
    # Any replica may report the shared store's changes; a replica that leaves does not take them.
    feed.apply("r2", report([(1, B, False, Tier.SHARED)], first_seq=1))
    assert feed.retain(["r2", "r3"]) == ["r1"]
    assert index.match_tiers([A, B], ["r2", "r3"]) == {"r2": (Tier.SHARED,), "r3": (Tier.SHARED,)}
    assert index.num_blocks(SHARED_STORE) == 1 and index.replica_ids() == ["r2"]
