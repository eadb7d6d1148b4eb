"""Flow control's decisions: admit, wait or shed; strict bands, fair tenants, deadlines, quotas and bounds."""

from __future__ import annotations

import pytest

from router.flow_capacity import ReplicaReport, queue_wait_s
from router.flow_config import Band, FlowConfig, FlowIdentity, SaturationConfig, Tenant
from router.flow_control import Admit, FlowController, Shed, ShedReason, Wait
from router.latency import Prediction

BANDS = (Band("interactive", None, 0, 2.0), Band("batch", 1, None))
INTERACTIVE, BATCH = 0, 1


def controller(*tenants: Tenant, band_reserve: float = 0.0, **changes) -> FlowController:
    tenants = tenants or (Tenant("a"), Tenant("b"), Tenant("c"))
    config = FlowConfig(bands=BANDS, tenants=tenants, default_tenant="a", trust_tenant_header=True,
                        saturation=SaturationConfig(max_waiting=4, max_report_age_s=3.0, band_reserve=band_reserve),
                        **changes)
    return FlowController(config)


def request(control: FlowController, request_id: str, tenant: str = "a", priority: int = BATCH, prompt: int = 100,
            output: int = 100, now: float = 0.0, slo: str | None = None):
    return control.classify(request_id, FlowIdentity(tenant_header=tenant, priority=priority, slo_ttft_header=slo),
                            prompt, output, now)


def decide(control: FlowController, request_id: str, now: float = 0.0, prediction: Prediction | None = None,
           **fields):
    return control.decide(request(control, request_id, now=now, **fields), prediction, now)


def predicted(ttft_s: float, compute_s: float) -> Prediction:
    return Prediction("p0", ttft_s, compute_s, num_decoding=0, matched_tokens=0)


def block(control: FlowController, now: float = 0.0) -> None:
    """One request in flight and a report of a full pool: the limit is 1, so everything else waits."""
    assert isinstance(decide(control, "blocker", now), Admit)
    control.observe("decode", "d0", ReplicaReport(num_waiting=10, kv_usage=0.5), now)
    assert control.saturated(now)


def test_with_room_a_request_is_admitted_at_once():
    control = controller()
    outcome = decide(control, "r1")
    assert isinstance(outcome, Admit) and outcome.band == "batch" and outcome.level == BATCH
    assert not outcome.borrowing and outcome.waited_s == 0.0
    assert control.num_in_flight == 1 and control.counters.admitted == {("a", "batch"): 1}


def test_saturated_requests_wait_and_bands_are_served_strictly_in_order():
    control = controller()
    block(control)
    for request_id in ("b1", "b2"):
        assert isinstance(decide(control, request_id, tenant="b"), Wait)
    assert isinstance(decide(control, "i1", tenant="c", priority=INTERACTIVE), Wait)
    order = []
    for step in range(3):
        control.finished("blocker" if step == 0 else order[-1], 10, 1.0 + step)
        [admitted] = control.poll(1.0 + step)
        order.append(admitted.request.request_id)
    assert order == ["i1", "b1", "b2"]
    assert admitted.waited_s == 3.0


def test_with_a_reserve_each_band_leaves_a_share_of_the_limit_to_the_bands_above():
    control = controller(band_reserve=0.25)
    for index in range(4):
        assert isinstance(decide(control, f"batch-{index}"), Admit)  # nothing reported yet: nothing held back
    control.observe("decode", "d0", ReplicaReport(num_waiting=4, kv_usage=0.5), 0.0)  # full: the limit is 4
    control.finished("batch-0", 10, 0.1)  # 3 in flight: under the limit, at the batch band's 3/4 of it
    assert isinstance(decide(control, "batch-4", 0.1), Wait)
    assert isinstance(decide(control, "urgent", 0.1, priority=INTERACTIVE), Admit)
    control.finished("urgent", 10, 0.2)
    assert control.poll(0.2) == []  # 3 in flight again: the batch band's share is still full
    control.finished("batch-1", 10, 0.3)
    assert [outcome.request.request_id for outcome in control.poll(0.3)] == ["batch-4"]


def test_tenants_share_a_band_by_weight_in_tokens():
    control = controller(Tenant("a"), Tenant("b"), Tenant("c", weight=2.0))
    block(control)
    for tenant in ("a", "b", "c"):
        for index in range(12):
            decide(control, f"{tenant}{index}", tenant=tenant)
    served = {"a": 0, "b": 0, "c": 0}
    last = "blocker"
    for step in range(16):
        control.finished(last, 10, 1.0)
        [admitted] = control.poll(1.0)
        last = admitted.request.request_id
        served[admitted.request.tenant] += 1
    assert served == {"a": 4, "b": 4, "c": 8}


def test_within_a_tenant_the_earliest_deadline_goes_first():
    control = controller()
    block(control)
    decide(control, "late", priority=INTERACTIVE, slo="1900")
    decide(control, "soon", priority=INTERACTIVE, slo="500")
    decide(control, "default", priority=INTERACTIVE)  # the band's 2 s
    order, last = [], "blocker"
    for _ in range(3):
        control.finished(last, 10, 0.1)
        [admitted] = control.poll(0.1)
        last = admitted.request.request_id
        order.append(last)
    assert order == ["soon", "late", "default"]


def test_deadline_shedding_against_known_predictions():
    """Queue drain at 1000 tokens/s; each interactive request costs 1000 tokens; the band's deadline is 2 s,
    the margin 10%: a request is shed when its queue wait plus the routers' TTFT passes 2.2 s."""
    control = controller(shed_margin=0.1)
    block(control)
    control.drain.note(0.0, backlogged=True)
    control.drain.note(10.0, backlogged=True, dispatched_tokens=10_000)
    assert control.drain.tokens_per_s() == pytest.approx(1000.0)
    ask = dict(tenant="a", priority=INTERACTIVE, prompt=500, output=500, now=10.0)
    assert decide(control, "b-batch", now=10.0, tenant="b", prompt=5000, output=5000).predicted_wait_s == 0.0
    first = decide(control, "i1", **ask)
    second = decide(control, "i2", **ask)
    assert (first.predicted_wait_s, second.predicted_wait_s) == (0.0, 1.0)  # the batch request is behind them
    shed = decide(control, "i3", prediction=predicted(0.5, 0.3), **ask)
    assert isinstance(shed, Shed) and shed.reason is ShedReason.DEADLINE
    assert shed.predicted_ttft_s == pytest.approx(2.5)  # 2000 tokens ahead (2 s), then 0.5 s
    assert shed.retry_after_s == pytest.approx(2.2)  # the queue's drain, and the replica's own 0.2 s wait
    assert (shed.tokens_ahead, shed.queue_drain_s, shed.band) == (2000, 2.0, "interactive")
    # Another tenant is not behind all of a's: weighted fair queuing puts 1000 of a's tokens ahead of it.
    fair = decide(control, "i4", prediction=predicted(0.5, 0.3), **{**ask, "tenant": "b"})
    assert isinstance(fair, Wait) and fair.predicted_wait_s == pytest.approx(1.0)
    # A later deadline of its own: 3000 ahead, 3.5 s against 5 s.
    patient = decide(control, "i5", prediction=predicted(0.5, 0.3), **{**ask, "slo": "5000"})
    assert isinstance(patient, Wait) and patient.predicted_wait_s == pytest.approx(3.0)
    # Just within the margin: 2 s of queue and 0.2 s at the replica is 2.2 s, not past it.
    just = decide(control, "i6", prediction=predicted(0.2, 0.2), **{**ask, "tenant": "c"})
    assert isinstance(just, Wait)
    assert control.counters.shed == {("a", "interactive", ShedReason.DEADLINE): 1}


def test_a_request_that_would_make_its_deadline_is_never_shed():
    control = controller(shed_margin=0.0)
    block(control)
    control.drain.note(0.0, backlogged=True)
    control.drain.note(1.0, backlogged=True, dispatched_tokens=1000)  # 1000 tokens/s
    for index in range(19):  # 100-token requests: the i-th has i * 0.1 s of queue ahead of it
        outcome = decide(control, f"i{index}", now=1.0, priority=INTERACTIVE, prompt=50, output=50,
                         prediction=predicted(0.1, 0.1))
        assert isinstance(outcome, Wait), index  # at most 1.8 + 0.1 s against 2 s
    assert isinstance(decide(control, "i20", now=1.0, priority=INTERACTIVE, prompt=50, output=50,
                             prediction=predicted(0.2, 0.1)), Shed)  # 1.9 + 0.2 s


def test_with_room_a_request_the_replica_alone_would_make_late_is_shed_at_once():
    control = controller()
    outcome = decide(control, "slow", priority=INTERACTIVE, prediction=predicted(3.0, 0.5))
    assert isinstance(outcome, Shed) and outcome.reason is ShedReason.DEADLINE
    assert outcome.retry_after_s == pytest.approx(2.5) and outcome.tokens_ahead == 0
    assert isinstance(decide(control, "batch", prediction=predicted(30.0, 0.5)), Admit)  # no deadline


def test_a_waiting_request_expires_once_dispatching_it_would_miss_its_deadline():
    control = controller()
    block(control)
    decide(control, "i1", priority=INTERACTIVE, slo="1000", prediction=predicted(0.2, 0.2))
    decide(control, "b1", tenant="b")
    assert control.next_wake_s() == pytest.approx(0.8)
    assert control.poll(0.79) == []
    [expired] = control.poll(0.8)
    assert isinstance(expired, Shed) and expired.reason is ShedReason.EXPIRED
    assert expired.predicted_ttft_s == pytest.approx(1.0)
    assert control.next_wake_s() is None and control.num_waiting == 1
    assert control.counters.shed == {("a", "interactive", ShedReason.EXPIRED): 1}


def test_a_deadline_counts_the_lighter_tenants_arrivals_that_will_pass_it():
    """Drain 1000 tokens/s. a has sent 2000-token interactive requests once a second, admitted at once; now c
    has one 1000-token interactive request waiting. c's next one has 1000 tokens ahead (1 s), but a's new
    requests pass it under fair queuing, up to c's tag (2000 tokens), at a's recent rate: its predicted wait
    is queue_wait_s's, 3 s, and it is shed at once rather than left to expire. Without a's traffic it would
    wait 1.5 s in all and be kept."""
    control = controller(shed_margin=0.1)
    for second in range(10):
        assert isinstance(decide(control, f"a{second}", now=float(second), priority=INTERACTIVE, prompt=1000,
                                 output=1000), Admit)
        control.finished(f"a{second}", 1000, second + 0.5)
    block(control, 10.0)
    control.drain.note(0.0, backlogged=True)
    control.drain.note(10.0, backlogged=True, dispatched_tokens=10_000)
    ask = dict(tenant="c", priority=INTERACTIVE, prompt=500, output=500, now=10.0,
               prediction=predicted(0.5, 0.3))
    assert isinstance(decide(control, "c1", **ask), Wait)
    rate_a = control.arrivals.fraction((INTERACTIVE, "a"), 10.0)
    wait = queue_wait_s(1000.0, 1000.0, [(rate_a, 2000.0)])
    assert rate_a > 500 and wait == pytest.approx(3.0)
    shed = decide(control, "c2", **ask)
    assert isinstance(shed, Shed) and shed.reason is ShedReason.DEADLINE
    assert shed.predicted_ttft_s == pytest.approx(wait + 0.5)
    assert shed.retry_after_s == pytest.approx(1.0 + 0.2)  # the drain of what is ahead now, as before
    quiet = controller(shed_margin=0.1)
    block(quiet, 10.0)
    quiet.drain.note(0.0, backlogged=True)
    quiet.drain.note(10.0, backlogged=True, dispatched_tokens=10_000)
    assert isinstance(decide(quiet, "c1", **ask), Wait) and isinstance(decide(quiet, "c2", **ask), Wait)


def test_a_tenant_over_its_queue_bound_is_shed_and_makes_room_only_from_its_lower_bands():
    control = controller(Tenant("a", max_queued=2), Tenant("b"), Tenant("c"))
    block(control)
    assert isinstance(decide(control, "a-batch-1"), Wait) and isinstance(decide(control, "a-batch-2"), Wait)
    over = decide(control, "a-batch-3")
    assert isinstance(over, Shed) and over.reason is ShedReason.TENANT_QUEUE
    assert over.retry_after_s == 3.0  # no drain measured yet: when fresh reports could say there is room
    assert isinstance(decide(control, "b-batch", tenant="b"), Wait)  # b's queue is its own
    assert isinstance(decide(control, "a-urgent-1", priority=INTERACTIVE), Wait)
    [displaced] = control.poll(0.0)  # a's batch request due last makes the room
    assert displaced.reason is ShedReason.DISPLACED and displaced.request.request_id == "a-batch-2"
    assert isinstance(decide(control, "a-urgent-2", priority=INTERACTIVE), Wait)
    assert [outcome.request.request_id for outcome in control.poll(0.0)] == ["a-batch-1"]
    over = decide(control, "a-urgent-3", priority=INTERACTIVE)  # a holds two interactive: none is taken
    assert isinstance(over, Shed) and over.reason is ShedReason.TENANT_QUEUE
    assert sorted(outcome.request_id for outcome in control.queue) == ["a-urgent-1", "a-urgent-2", "b-batch"]
    assert control.counters.shed == {("a", "batch", ShedReason.TENANT_QUEUE): 1,
                                     ("a", "batch", ShedReason.DISPLACED): 2,
                                     ("a", "interactive", ShedReason.TENANT_QUEUE): 1}


@pytest.mark.parametrize("queue_reserve", [0.25, 0.0])
def test_a_less_urgent_band_is_told_on_arrival_where_the_reserve_keeps_room_for_the_more_urgent(queue_reserve):
    """A tenant bound of 8: batch queues into ceil(8 x 0.75) = 6 places, borrowed traffic into ceil(8 x 0.75^2) = 5,
    and interactive requests find the other two free, displacing nobody; past the whole bound they displace as
    before. Without a reserve the batch requests take all 8, and the interactive ones displace two of them."""
    control = controller(Tenant("a", max_queued=8), Tenant("b"), Tenant("c"), queue_reserve=queue_reserve)
    block(control)
    batch = [decide(control, f"a-batch-{number}") for number in range(8)]
    queued = 6 if queue_reserve else 8
    assert all(isinstance(outcome, Wait) for outcome in batch[:queued])
    assert all(isinstance(outcome, Shed) and outcome.reason is ShedReason.TENANT_QUEUE for outcome in batch[queued:])
    assert all(isinstance(decide(control, f"a-urgent-{number}", priority=INTERACTIVE), Wait) for number in range(3))
    displaced = [outcome.request.request_id for outcome in control.poll(0.0)]
    assert displaced == (["a-batch-5"] if queue_reserve else ["a-batch-7", "a-batch-6", "a-batch-5"])
    assert control.queue.num_queued("a") == 8


def test_borrowed_traffic_queues_into_the_least_of_the_bound():
    control = controller(Tenant("a", quota_tokens_per_min=60, max_queued=8), queue_reserve=0.25)
    block(control)
    outcomes = [decide(control, f"a-borrowing-{number}") for number in range(6)]
    assert all(isinstance(outcome, Wait) for outcome in outcomes[:5])
    assert isinstance(outcomes[5], Shed) and outcomes[5].reason is ShedReason.TENANT_QUEUE


def test_a_full_queue_never_sheds_a_higher_band_for_a_lower_one():
    control = controller(max_queued=3)
    block(control)
    decide(control, "a-i", tenant="a", priority=INTERACTIVE)
    decide(control, "b-batch", tenant="b")
    decide(control, "c-batch", tenant="c")
    full = decide(control, "c-batch-2", tenant="c")
    assert isinstance(full, Shed) and full.reason is ShedReason.QUEUE_FULL  # no lower band to take room from
    assert isinstance(decide(control, "b-i", tenant="b", priority=INTERACTIVE), Wait)
    assert isinstance(decide(control, "c-i", tenant="c", priority=INTERACTIVE), Wait)
    displaced = control.poll(0.0)
    assert [(outcome.request.request_id, outcome.reason) for outcome in displaced] == [
        ("c-batch", ShedReason.DISPLACED), ("b-batch", ShedReason.DISPLACED)]
    full = decide(control, "a-i-2", tenant="a", priority=INTERACTIVE)
    assert isinstance(full, Shed) and full.reason is ShedReason.QUEUE_FULL  # never an interactive one's room
    assert sorted(outcome.request_id for outcome in control.queue) == ["a-i", "b-i", "c-i"]


def test_over_quota_traffic_borrows_idle_capacity_and_gives_it_back():
    control = controller(Tenant("a"), Tenant("b"), Tenant("c", quota_tokens_per_min=600))
    paid = decide(control, "c1", tenant="c", prompt=100, output=400)
    borrowed = decide(control, "c2", tenant="c", prompt=100, output=400)
    assert isinstance(paid, Admit) and not paid.borrowing and paid.level == BATCH
    assert isinstance(borrowed, Admit) and borrowed.borrowing  # nobody else wants the capacity: not refused
    assert borrowed.level == 2 and borrowed.band == "batch"  # queued below every band
    urgent = decide(control, "c-urgent", tenant="c", priority=INTERACTIVE, prompt=100, output=400)
    assert urgent.borrowing and urgent.level == 2 and urgent.band == "interactive"  # counted under its own band
    control.finished("c-urgent", 400, 0.0)
    assert control.counters.borrowed == {"c": 2}
    assert control.counters.admitted == {("c", "batch"): 2, ("c", "interactive"): 1}
    assert control.buckets["c"].level(0.0) == pytest.approx(100.0)
    control.finished("c1", 100, 0.0)  # 200 of its 500 tokens used: 300 back
    assert control.buckets["c"].level(0.0) == pytest.approx(400.0)
    control.finished("c2", 400, 0.0)  # borrowed: nothing was taken, nothing comes back
    assert control.buckets["c"].level(0.0) == pytest.approx(400.0)
    assert control.counters.served_tokens == {"c": 1200}
    # Others want the capacity back: borrowed traffic waits behind their batch, and is shed first.
    block(control, 0.0)
    decide(control, "c3", tenant="c", prompt=100, output=400)  # 400 in the bucket: borrows
    decide(control, "a1", tenant="a")
    control.finished("blocker", 10, 0.1)
    [first] = control.poll(0.1)
    assert first.request.request_id == "a1"


def test_borrowed_traffic_is_the_first_displaced():
    control = controller(Tenant("a"), Tenant("b"), Tenant("c", quota_tokens_per_min=60), max_queued=2)
    block(control)
    decide(control, "c-borrowing", tenant="c", prompt=100, output=400)
    decide(control, "b-batch", tenant="b")
    assert isinstance(decide(control, "a-batch", tenant="a"), Wait)
    [displaced] = control.poll(0.0)
    assert displaced.request.request_id == "c-borrowing" and displaced.borrowing
    assert displaced.band == "batch" and displaced.reason is ShedReason.DISPLACED


def test_a_shed_request_gives_its_quota_back():
    control = controller(Tenant("a", quota_tokens_per_min=1000, max_queued=0))
    block(control)
    assert control.buckets["a"].level(0.0) == pytest.approx(1000.0 - 200)  # the blocker's
    assert isinstance(decide(control, "shed"), Shed)
    assert control.buckets["a"].level(0.0) == pytest.approx(800.0)


def test_stale_reports_count_as_saturated():
    control = controller()
    control.observe("decode", "d0", ReplicaReport(num_waiting=0, kv_usage=0.1), 0.0)
    assert isinstance(decide(control, "fresh", now=2.0), Admit)
    assert isinstance(decide(control, "stale", now=3.5), Wait)  # nothing in flight but the one, room reported
    assert control.poll(3.6) == []
    control.observe("decode", "d0", ReplicaReport(num_waiting=0, kv_usage=0.1), 4.0)
    [admitted] = control.poll(4.0)
    assert admitted.request.request_id == "stale" and admitted.waited_s == pytest.approx(0.5)
    control.forget("decode", "d0")


def test_a_cancelled_waiting_request_leaves_the_queue():
    control = controller()
    block(control)
    decide(control, "gone")
    assert control.cancel("gone", 0.5) and not control.cancel("gone", 0.5)
    control.finished("blocker", 1, 1.0)
    assert control.poll(1.0) == []
    assert control.counters.cancelled == {("a", "batch"): 1}


def test_counters_name_tenant_band_and_reason():
    control = controller(Tenant("a", max_queued=1), Tenant("b"))
    block(control)
    decide(control, "a1")
    decide(control, "a2")
    decide(control, "b1", tenant="b", priority=INTERACTIVE, prediction=predicted(9.0, 1.0))
    assert control.counters.shed == {("a", "batch", ShedReason.TENANT_QUEUE): 1,
                                     ("b", "interactive", ShedReason.DEADLINE): 1}
    assert control.counters.admitted == {("a", "batch"): 1}
    control.finished("blocker", 50, 1.0)
    assert control.counters.served_tokens == {"a": 150}
    assert "deadline" in Shed(request(control, "x"), ShedReason.DEADLINE, 1.5, "batch", False).message()


def test_calls_out_of_turn_are_refused():
    control = controller()
    decide(control, "r1")
    with pytest.raises(ValueError, match="decided already"):
        decide(control, "r1")
    with pytest.raises(ValueError, match="not in flight"):
        control.finished("nope", 1, 0.0)
