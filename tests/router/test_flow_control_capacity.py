"""What flow control knows of capacity: saturation from reports, the limit in flight, drain rate, token buckets."""

from __future__ import annotations

import math

import pytest

from router.flow_capacity import Capacity, DrainRate, ReplicaReport, TokenBucket, queue_wait_s
from router.flow_config import SaturationConfig
from router.protocol import RoutingStats

CONFIG = SaturationConfig(max_waiting=4, max_kv_usage=0.9, max_backlog_s=2.0, max_step_s=0.1, max_report_age_s=3.0)


def report(waiting: int = 0, kv: float = 0.1, backlog: float | None = None) -> ReplicaReport:
    return ReplicaReport(waiting, kv, backlog)


def test_nothing_is_held_back_before_any_report():
    capacity = Capacity(CONFIG)
    assert capacity.limit is None and not capacity.saturated(0.0, 10_000)


def test_the_limit_is_what_is_in_flight_plus_the_pools_queue_room():
    capacity = Capacity(CONFIG)
    capacity.observe("prefill", "p0", report(waiting=3), 0.0, num_in_flight=20)  # room 1: not keeping up (3 > 2)
    assert capacity.limit == 21
    capacity.observe("decode", "d0", report(waiting=0), 0.0, num_in_flight=20)
    capacity.observe("decode", "d1", report(waiting=2), 0.0, num_in_flight=20)
    assert capacity.limit == 21  # the pool with least room decides: prefill's 1, not decode's 6
    capacity.observe("prefill", "p0", report(waiting=9), 0.5, num_in_flight=20)  # 5 over: no room, excess counted
    assert capacity.limit == 15
    assert capacity.full_pools(0.5) == ["prefill"]


def test_a_replica_over_its_kv_or_backlog_bound_has_no_room():
    capacity = Capacity(CONFIG)
    capacity.observe("decode", "d0", report(waiting=0, kv=0.95), 0.0, num_in_flight=8)
    assert capacity.full_pools(0.0) == ["decode"] and capacity.limit == 8
    capacity.observe("decode", "d0", report(waiting=6, backlog=2.5), 0.0, num_in_flight=8)
    assert capacity.limit == 6  # over the backlog bound, and 2 over the queue bound


def test_a_decode_replica_whose_predicted_step_passes_the_bound_has_no_room():
    capacity = Capacity(CONFIG)
    capacity.observe("decode", "d0", ReplicaReport(0, 0.1, None, step_s=0.05), 0.0, num_in_flight=8)
    assert capacity.full_pools(0.0) == []
    capacity.observe("decode", "d0", ReplicaReport(0, 0.1, None, step_s=0.12), 1.0, num_in_flight=8)
    assert capacity.full_pools(1.0) == ["decode"] and capacity.limit == 8  # a batch past its ITL: no growth
    with pytest.raises(ValueError, match="max_step_s must be > 0"):
        SaturationConfig(max_step_s=0)


def test_without_a_backlog_requests_go_at_once_while_every_pool_has_room():
    capacity = Capacity(CONFIG)
    capacity.observe("decode", "d0", report(waiting=3), 0.0, num_in_flight=10)
    assert capacity.limit == 11
    assert not capacity.saturated(0.1, 50, backlogged=False)  # room reported, nothing waits: at once
    assert capacity.saturated(0.1, 11, backlogged=True)  # requests wait already: the limit paces them
    capacity.observe("decode", "d0", report(waiting=4), 0.2, num_in_flight=10)
    assert capacity.saturated(0.3, 10, backlogged=False)  # full: the limit holds even the first


def test_where_the_engines_keep_up_the_limit_grows_with_the_peak_in_flight():
    capacity = Capacity(CONFIG)
    capacity.observe("decode", "d0", report(waiting=0), 0.0, num_in_flight=4)
    for num_in_flight in range(5, 13):
        capacity.note_in_flight(num_in_flight)
    capacity.observe("decode", "d0", report(waiting=1), 1.0, num_in_flight=6, backlogged=False)
    assert capacity.limit == 24  # the peak, 12, doubled (IDLE_GROWTH) rather than 12 + 3
    capacity.observe("decode", "d0", report(waiting=1), 2.0, num_in_flight=6, backlogged=True)
    assert capacity.limit == 9  # with a backlog: 6 * 1.5 (BACKLOG_GROWTH); the peak was reset at the last report


def test_a_stale_report_counts_as_saturated():
    capacity = Capacity(CONFIG)
    capacity.observe("prefill", "p0", report(), 0.0, num_in_flight=0)
    capacity.observe("decode", "d0", report(), 2.0, num_in_flight=0)
    assert not capacity.saturated(3.0, 0, backlogged=False)
    assert capacity.stale_pools(3.5) == ["prefill"]
    assert capacity.saturated(3.5, 0, backlogged=False)  # nothing in flight, room reported: stale all the same
    capacity.observe("prefill", "p1", report(), 3.5, num_in_flight=0)  # another replica of it reports
    assert not capacity.saturated(3.6, 0, backlogged=False)
    capacity.forget("prefill", "p1")
    assert capacity.saturated(3.6, 0, backlogged=False)


def test_ingress_replicas_share_the_room():
    capacity = Capacity(CONFIG, num_ingress=2)
    capacity.observe("decode", "d0", report(waiting=3), 0.0, num_in_flight=5)
    capacity.observe("decode", "d1", report(waiting=3), 0.0, num_in_flight=5)
    assert capacity.limit == 6  # 2 of room, half of it this ingress's
    with pytest.raises(ValueError, match="num_ingress"):
        Capacity(CONFIG, num_ingress=0)


def test_a_report_is_read_from_routing_stats():
    stats = RoutingStats(num_running=3, num_waiting=5, kv_usage=0.25)
    assert ReplicaReport.of(stats, backlog_s=0.5) == ReplicaReport(5, 0.25, 0.5)


def test_the_drain_rate_counts_tokens_dispatched_while_requests_waited():
    drain = DrainRate(half_life_s=10.0, min_span_s=1.0)
    assert drain.tokens_per_s() is None
    drain.note(0.0, backlogged=False)
    drain.note(5.0, backlogged=True, dispatched_tokens=999)  # dispatched with nothing waiting before: no span
    assert drain.tokens_per_s() is None
    drain = DrainRate(half_life_s=10.0, min_span_s=1.0)
    drain.note(0.0, backlogged=True)
    drain.note(10.0, backlogged=True, dispatched_tokens=5000)
    assert drain.tokens_per_s() == pytest.approx(500.0)
    drain.note(20.0, backlogged=False, dispatched_tokens=5000)  # the same rate again: older tokens decayed
    assert drain.tokens_per_s() == pytest.approx((5000 * 0.5 + 5000) / (10 * 0.5 + 10))
    drain.note(100.0, backlogged=False)  # idle time is no span
    assert drain.tokens_per_s() == pytest.approx((5000 * 0.5 + 5000) / (10 * 0.5 + 10))


def test_a_token_bucket_refills_at_its_rate_up_to_one_minute():
    bucket = TokenBucket(600)  # 10 a second
    assert bucket.take(600, 0.0) and not bucket.take(1, 0.0)
    assert not bucket.take(50, 4.0) and bucket.level(4.0) == pytest.approx(40.0)  # refused: nothing taken
    assert bucket.take(50, 5.0) and bucket.level(5.0) == pytest.approx(0.0)
    bucket.give_back(30, 5.0)
    assert bucket.level(5.0) == pytest.approx(30.0)
    assert bucket.level(1000.0) == pytest.approx(600.0)  # never more than a minute's
    bucket.give_back(100, 1000.0)
    assert bucket.level(1000.0) == pytest.approx(600.0)
    with pytest.raises(ValueError, match="tokens_per_min"):
        TokenBucket(0)


@pytest.mark.parametrize("streams, wait", [
    ([], 10.0),  # 100 tokens ahead at 10 a second
    ([(5.0, math.inf)], 20.0),  # a more urgent band arriving at half the drain: 100 / (10 - 5)
    ([(5.0, 50.0)], 15.0),  # a lighter tenant passing until its 50 tokens of room are used (at 10 s): 150 / 10
    ([(20.0, 30.0), (0.0, 99.0), (4.0, 0.0)], 13.0),  # faster than the drain but bounded; idle or roomless ones
    ([(20.0, math.inf)], math.inf),  # a more urgent band arriving faster than the queue drains: never
    ([(2.0, 10.0), (5.0, math.inf)], 22.0),  # the bounded one full at 5 s: (100 + 10) / (10 - 5)
])
def test_the_queue_wait_counts_the_arrivals_that_pass_a_request(streams, wait):
    assert queue_wait_s(100.0, 10.0, streams) == pytest.approx(wait)
