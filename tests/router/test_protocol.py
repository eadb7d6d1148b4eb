"""Replicas' routing stats on the wire: cache events carry the tier that holds a block."""

from __future__ import annotations

import pytest

from pd.engine.block_pool import CacheEventLog
from router.protocol import CacheEvent, RouteHints, RoutingStats, replica_load
from router.tiers import Tier
from tests.wire import sealed
from transfer.wire import WireError

A, B = b"a" * 8, b"b" * 8


def test_a_cache_event_with_a_tier_round_trips():
    stats = RoutingStats(cache_events_from=4, cache_events=tuple(
        CacheEvent(seq=4 + tier, block_hash=A, stored=tier != Tier.DISK, tier=tier) for tier in Tier))
    decoded = RoutingStats.decode(stats.encode())
    assert decoded == stats
    assert [event.tier for event in decoded.cache_events] == list(Tier)
    assert all(type(event.tier) is Tier for event in decoded.cache_events)
    assert CacheEvent(seq=0, block_hash=A, stored=True).tier is Tier.DEVICE  # what today's engines send


def test_an_unknown_tier_is_refused_naming_the_field():
    data = sealed("routing_stats", {"cache_events": [[0, A, True, 0], [1, B, True, 7]]})
    with pytest.raises(WireError, match=r"Invalid enum value 7 - at `\$.cache_events\[1\]\[3\]`"):
        RoutingStats.decode(data)


def test_stats_carry_the_engines_events_as_recorded():
    log = CacheEventLog()
    log.record(A, stored=True, tier=Tier.DEVICE)
    log.record(A, stored=True, tier=Tier.HOST)  # demoted: replaces the device event
    log.record(A, stored=True, tier=Tier.SHARED)  # the shared store's state stands apart
    log.record(B, stored=False, tier=Tier.DISK)
    first_seq, events = log.window()
    stats = RoutingStats.of(first_seq, events, num_running=1)
    assert [(e.seq, e.block_hash, e.stored, e.tier) for e in stats.cache_events] == [
        (1, A, True, Tier.HOST), (2, A, True, Tier.SHARED), (3, B, False, Tier.DISK)]
    assert all(sent is kept for sent, kept in zip(stats.cache_events, events, strict=True))  # one type: no copy
    assert RoutingStats.decode(stats.encode()) == stats


def test_adapter_fields_round_trip_and_reach_the_policies():
    hints = RouteHints(request_id="r", num_prompt_tokens=3, block_hashes=(A,), adapter="sql")
    assert RouteHints.decode(hints.encode()) == hints
    assert RouteHints.decode(RouteHints(request_id="r").encode()).adapter is None  # the base model
    stats = RoutingStats(num_running=2, adapters=("sql", "chat"), max_loras=4)
    decoded = RoutingStats.decode(stats.encode())
    assert decoded == stats and decoded.adapters == ("sql", "chat") and decoded.max_loras == 4
    load = replica_load("a", decoded)
    assert (load.adapters, load.max_loras) == (("sql", "chat"), 4)
    # A replica that names none (no LoRA, or an engine from before adapters) reports no slots.
    assert RoutingStats.decode(sealed("routing_stats", {"num_running": 1})).max_loras == 0


@pytest.mark.parametrize("body, message", [
    ({"adapters": ["a", "b"], "max_loras": 1}, r"2 adapters held in 1 slots"),
    ({"adapters": ["a", "a"], "max_loras": 4}, r"each adapter once"),
    ({"adapters": [""], "max_loras": 4}, r"at `\$.adapters\[0\]`"),
    ({"max_loras": -1}, r"at `\$.max_loras`"),
    ({"adapters": "sql", "max_loras": 4}, r"at `\$.adapters`"),
])
def test_bad_adapter_reports_are_refused_naming_the_field(body, message):
    with pytest.raises(WireError, match=message):
        RoutingStats.decode(sealed("routing_stats", body))


def test_an_empty_adapter_name_in_hints_is_refused():
    with pytest.raises(WireError, match=r"at `\$.adapter`"):
        RouteHints.decode(sealed("route_hints", {"request_id": "r", "adapter": ""}))
