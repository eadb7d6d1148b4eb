"""Flow control's queue: levels strictly in order, weighted fair queuing in tokens, earliest deadline first."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from router.flow_queue import FlowQueue, Queued

_seq = itertools.count()


def entry(request_id: str, tenant: str, level: int = 0, cost: int = 100, deadline: float = math.inf) -> Queued:
    return Queued(request_id, tenant, level, cost, deadline, next(_seq))


def fill(queue: FlowQueue, tenant: str, count: int, level: int = 0, cost: int = 100) -> None:
    for index in range(count):
        queue.push(entry(f"{tenant}{level}-{index}", tenant, level, cost))


def served(queue: FlowQueue, count: int) -> Counter[str]:
    return Counter(queue.pop().tenant for _ in range(count))


def test_levels_are_served_strictly_in_order():
    queue = FlowQueue(3, {"a": 1.0, "b": 1.0})
    fill(queue, "a", 3, level=2)
    fill(queue, "b", 3, level=1)
    queue.push(entry("urgent", "a", level=0))
    assert [queue.pop().level for _ in range(7)] == [0, 1, 1, 1, 2, 2, 2]
    assert len(queue) == 0 and queue.peek() is None


def test_equal_weights_share_tokens_equally_however_many_requests_a_tenant_sends():
    queue = FlowQueue(1, {"a": 1.0, "b": 1.0, "c": 1.0})
    fill(queue, "c", 70)  # c sends 70% of the requests
    fill(queue, "a", 15)
    fill(queue, "b", 15)
    assert served(queue, 30) == {"a": 10, "b": 10, "c": 10}
    # The first three in the tenants' order: equal tags, ties broken by the order tenants are configured in.
    queue = FlowQueue(1, {"a": 1.0, "b": 1.0, "c": 1.0})
    for tenant in ("c", "b", "a"):
        fill(queue, tenant, 2)
    assert [queue.pop().tenant for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_weights_share_in_proportion():
    queue = FlowQueue(1, {"a": 2.0, "b": 1.0})
    fill(queue, "a", 40)
    fill(queue, "b", 40)
    assert served(queue, 30) == {"a": 20, "b": 10}


def test_shares_are_in_tokens_not_requests():
    queue = FlowQueue(1, {"a": 1.0, "b": 1.0})
    fill(queue, "a", 10, cost=300)
    fill(queue, "b", 30, cost=100)
    taken = [queue.pop() for _ in range(20)]
    tokens = Counter()
    for item in taken:
        tokens[item.tenant] += item.cost
    assert Counter(item.tenant for item in taken) == {"a": 5, "b": 15}
    assert tokens["a"] == tokens["b"] == 1500


def test_a_tenant_returning_from_idle_is_neither_owed_nor_charged_for_the_past():
    queue = FlowQueue(1, {"a": 1.0, "b": 1.0})
    fill(queue, "a", 10)
    assert served(queue, 10) == {"a": 10}  # a alone: it had everything
    fill(queue, "b", 10)
    fill(queue, "a", 10, level=0, cost=100)  # (new ids: a second batch of a's)
    # Neither tenant runs ahead: b is not served 10 in a row for the time it was idle, nor a starved for its past.
    assert served(queue, 10) == {"a": 5, "b": 5}


def test_within_a_tenant_the_earliest_deadline_goes_first_then_arrival_order():
    queue = FlowQueue(1, {"a": 1.0})
    for request_id, deadline in (("late", 5.0), ("none-1", math.inf), ("soon", 1.0), ("mid", 3.0),
                                 ("none-2", math.inf)):
        queue.push(entry(request_id, "a", deadline=deadline))
    assert [queue.pop().request_id for _ in range(5)] == ["soon", "mid", "late", "none-1", "none-2"]


def test_removed_requests_are_skipped_and_counted_out():
    queue = FlowQueue(2, {"a": 1.0, "b": 1.0})
    fill(queue, "a", 3)
    fill(queue, "b", 2, level=1)
    assert queue.remove("a0-0").request_id == "a0-0"
    assert queue.remove("a0-0") is None
    assert queue.num_queued("a") == 2 and len(queue) == 4 and queue.num_queued_through(0) == 2
    assert [queue.pop().request_id for _ in range(4)] == ["a0-1", "a0-2", "b1-0", "b1-1"]
    # An id queued again after it was removed is one request, not two.
    queue.push(entry("x", "a", level=1))
    queue.remove("x")
    queue.push(entry("x", "a", level=0))
    assert queue.pop().request_id == "x" and len(queue) == 0 and queue.peek() is None


def test_tokens_ahead_counts_the_levels_above_earlier_deadlines_and_other_tenants_by_tag():
    queue = FlowQueue(2, {"a": 1.0, "b": 1.0})
    fill(queue, "b", 3, level=0, cost=100)  # b: tags 100, 200, 300 in level 0
    queue.push(entry("a-soon", "a", level=0, cost=100, deadline=1.0))
    queue.push(entry("a-late", "a", level=0, cost=100, deadline=9.0))
    fill(queue, "a", 4, level=1, cost=50)
    # A level-1 request of b stands behind all of level 0 (500 tokens) and, at its own level, a's tokens whose
    # tags come before its own (its tag: 0 + 100 = 100; a's: 50, 100, 150, 200 -> 100 of them).
    assert queue.tokens_ahead("b", 1, 100, (math.inf, 10**9)) == 500 + 100
    # A level-0 request of a due at 5.0: a-soon before it (100), its tag 0 + 200 = 200, b's two first (200).
    assert queue.tokens_ahead("a", 0, 100, (5.0, 10**9)) == 100 + 200
    # Due before everything a has: only b's first request shares its tag.
    assert queue.tokens_ahead("a", 0, 100, (0.5, 10**9)) == 100


def test_the_room_ahead_is_each_other_tenants_tokens_up_to_its_tag_and_every_level_above():
    queue = FlowQueue(2, {"a": 1.0, "b": 2.0, "c": 1.0})
    fill(queue, "a", 3, level=1, cost=100)  # a: tags 100, 200, 300
    fill(queue, "b", 1, level=1, cost=100)  # b: tag 50 (weight 2)
    # c's 100-token request at level 1: tag 100. Ahead: a's first (100) and b's (100). Room: a's tokens after
    # its queue cannot come before tag 100 (its queue reaches 300); b's may, to 100 x 2 less the 100 queued.
    ahead, room = queue.ahead_and_room("c", 1, 100, (math.inf, 10**9))
    assert ahead == 200 and room == {(0, None): math.inf, (1, "b"): 100.0}
    ahead, room = queue.ahead_and_room("a", 0, 100, (math.inf, 10**9))  # the top level, nothing queued there
    assert ahead == 0 and room == {(0, "b"): 200.0, (0, "c"): 100.0}


def test_last_is_the_request_served_last_below_a_level():
    queue = FlowQueue(3, {"a": 1.0, "b": 1.0})
    fill(queue, "a", 2, level=0)
    queue.push(entry("b-mid-1", "b", level=1, deadline=2.0))
    queue.push(entry("b-mid-2", "b", level=1, deadline=1.0))
    queue.push(entry("a-low", "a", level=2))
    fill(queue, "b", 3, level=2)  # b has more at level 2: its backlog is served last
    assert queue.last(0).request_id == "b2-2"
    assert queue.last(0, tenant="a").request_id == "a-low"
    assert queue.last(2) is None  # nothing below the lowest level
    queue.remove("a-low")
    for index in range(3):
        queue.remove(f"b2-{index}")
    assert queue.last(0).request_id == "b-mid-1"  # the later deadline of the next level up
    assert queue.last(1) is None  # never a request of the level itself or above


def test_bad_entries_are_refused():
    queue = FlowQueue(1, {"a": 1.0})
    queue.push(entry("x", "a"))
    with pytest.raises(ValueError, match="queued already"):
        queue.push(entry("x", "a"))
    with pytest.raises(ValueError, match="unknown tenant 'z'"):
        queue.push(entry("y", "z"))
    with pytest.raises(ValueError, match="level 3"):
        queue.push(entry("y", "a", level=3))
    with pytest.raises(ValueError, match="weight must be > 0"):
        FlowQueue(1, {"a": 0.0})
    queue.pop()
    with pytest.raises(IndexError):
        queue.pop()
