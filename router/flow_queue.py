"""Flow control's waiting requests, in the order they are to be dispatched.

    level 0 ─ the most urgent band  ┐
    level 1                          │ strictly in order: a level is served only
    ...                              │ while every level above it is empty
    level n ─ borrowed (over quota)  ┘
      within a level:  tenant a [EDF heap] ┐
                       tenant b [EDF heap] ├─ the tenant of least virtual finish tag
                       tenant c [EDF heap] ┘
      within a tenant: earliest deadline first, then arrival order

**Weighted fair queuing, in tokens.** Each level keeps a virtual time
``V`` and each tenant the finish tag of its last request served there.
The next request served is the head of the tenant of least tag

    start(t)  = last_finish(t)       (raised to V when t's queue there was empty and a request came)
    finish(t) = start(t) + cost(head of t) / weight(t)

after which ``last_finish(t) = finish(t)`` and ``V = max(V, start(t))``
(self-clocked: virtual time is the start of what was served last). While
tenants are backlogged, each is served tokens in proportion to its
weight, however many requests it sends; a tenant returning from idle
starts at ``V``, not owed its idle time.

``tokens_ahead`` prices where a request would stand: everything in the
levels above, its own tenant's requests due earlier, and each other
tenant's tokens whose tags come before its own.

Pure Python; removal is lazy (a removed entry stays in its heap until it
reaches the top).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping


@dataclass(frozen=True)
class Queued:
    """One waiting request, as the queue orders it."""

    request_id: str
    tenant: str
    level: int
    cost: int  # tokens
    deadline_at_s: float  # math.inf without a deadline
    seq: int  # arrival order, the tie-break

    @property
    def key(self) -> tuple[float, int]:
        """Its order within its tenant: earliest deadline, then first come."""
        return self.deadline_at_s, self.seq


@dataclass
class _Flow:
    """One tenant's requests in one level."""

    heap: list[tuple[float, int, int, str]] = field(default_factory=list)  # (deadline, seq, push id, request id)
    num_tokens: int = 0
    num_queued: int = 0
    last_finish: float = 0.0


@dataclass
class _Level:
    virtual: float = 0.0
    flows: dict[str, _Flow] = field(default_factory=dict)
    num_tokens: int = 0
    num_queued: int = 0


class FlowQueue:
    """``num_levels`` levels of tenants of ``weights`` (each tenant's; the order is the tie-break)."""

    def __init__(self, num_levels: int, weights: Mapping[str, float]) -> None:
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        for tenant, weight in weights.items():
            if not weight > 0:
                raise ValueError(f"tenant {tenant!r}: weight must be > 0, got {weight}")
        self._weights = dict(weights)
        self._rank = {tenant: index for index, tenant in enumerate(weights)}
        self._levels = [_Level(flows={tenant: _Flow() for tenant in weights}) for _ in range(num_levels)]
        self._entries: dict[str, Queued] = {}
        self._push_ids: dict[str, int] = {}  # a heap's item is live while its request's push id is this
        self._num_pushes = 0
        self._num_per_tenant = {tenant: 0 for tenant in weights}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> Queued | None:
        return self._entries.get(request_id)

    def num_queued(self, tenant: str) -> int:
        return self._num_per_tenant[tenant]

    def num_queued_through(self, level_index: int) -> int:
        """Requests waiting in ``level_index`` and the levels above it."""
        return sum(level.num_queued for level in self._levels[:level_index + 1])

    def push(self, entry: Queued) -> None:
        if entry.request_id in self._entries:
            raise ValueError(f"request {entry.request_id!r} is queued already")
        if entry.tenant not in self._weights:
            raise ValueError(f"unknown tenant {entry.tenant!r}")
        if not 0 <= entry.level < len(self._levels):
            raise ValueError(f"level {entry.level} is not in 0..{len(self._levels) - 1}")
        level = self._levels[entry.level]
        flow = level.flows[entry.tenant]
        if not flow.num_queued:  # newly backlogged: it starts now, not where it stopped
            flow.last_finish = max(flow.last_finish, level.virtual)
        self._num_pushes += 1
        self._push_ids[entry.request_id] = self._num_pushes
        heapq.heappush(flow.heap, (entry.deadline_at_s, entry.seq, self._num_pushes, entry.request_id))
        self._count(entry, level, flow, +1)

    def remove(self, request_id: str) -> Queued | None:
        """Take a request out wherever it stands (no service is counted); None if it is not queued."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        level = self._levels[entry.level]
        self._count(entry, level, level.flows[entry.tenant], -1)
        return entry

    def peek(self) -> Queued | None:
        """The request to dispatch next."""
        chosen = self._choose()
        return None if chosen is None else chosen[0]

    def pop(self) -> Queued:
        """Dispatch the next request: its tenant's finish tag and its level's virtual time advance."""
        chosen = self._choose()
        if chosen is None:
            raise IndexError("pop from an empty flow queue")
        entry, start, finish = chosen
        level = self._levels[entry.level]
        flow = level.flows[entry.tenant]
        flow.last_finish = finish
        level.virtual = max(level.virtual, start)
        self._count(entry, level, flow, -1)
        return entry

    def tokens_ahead(self, tenant: str, level_index: int, cost: int, key: tuple[float, int]) -> float:
        """The tokens dispatched before a request of ``tenant`` at ``level_index`` of ``cost`` and ``key``
        (queued or not), if nothing else arrived: the levels above, its tenant's requests of lesser key in its
        level, and every other tenant's there whose finish tag is before its own (a tenant's tokens taken as
        flowing continuously)."""
        return self.ahead_and_room(tenant, level_index, cost, key)[0]

    def ahead_and_room(self, tenant: str, level_index: int, cost: int,
                       key: tuple[float, int]) -> tuple[float, dict[tuple[int, str | None], float]]:
        """``tokens_ahead``, and the most tokens arriving later may still add before the request: by
        ``(level, tenant)``, each other tenant of its level up to its own finish tag (weighted fair queuing
        lets a tenant's new requests pass a heavier tenant's waiting ones), and ``(level, None)`` for each
        level above, without bound (math.inf)."""
        ahead = float(sum(level.num_tokens for level in self._levels[:level_index]))
        room: dict[tuple[int, str | None], float] = {(index, None): math.inf for index in range(level_index)}
        level = self._levels[level_index]
        own = level.flows[tenant]
        own_ahead = sum(self._entries[item[3]].cost for item in own.heap if self._live(item) and item[:2] < key)
        start = own.last_finish if own.num_queued else max(level.virtual, own.last_finish)
        finish = start + (own_ahead + cost) / self._weights[tenant]
        ahead += own_ahead
        for other, flow in level.flows.items():
            if other == tenant:
                continue
            weight = self._weights[other]
            counted = min(flow.num_tokens, max(0.0, (finish - flow.last_finish) * weight))
            before = max(0.0, (finish - max(level.virtual, flow.last_finish)) * weight)
            ahead += counted
            if before > counted:
                room[level_index, other] = before - counted
        return ahead, room

    def last(self, below_level: int, tenant: str | None = None) -> Queued | None:
        """The request dispatched last among those in levels below ``below_level`` (of ``tenant`` if given):
        the one that shedding takes first, so that room is never taken from a more urgent level."""
        for level in reversed(self._levels[below_level + 1:]):
            flows = [(name, flow) for name, flow in level.flows.items()
                     if flow.num_queued and (tenant is None or name == tenant)]
            if not flows:
                continue
            # The tenant whose backlog would be served last, then its request due last.
            name, flow = max(flows, key=lambda item: (
                item[1].last_finish + item[1].num_tokens / self._weights[item[0]], self._rank[item[0]]))
            return self._entries[max(item for item in flow.heap if self._live(item))[3]]
        return None

    def __iter__(self) -> Iterator[Queued]:
        """Every queued request, in no particular order."""
        return iter(list(self._entries.values()))

    # Internals ---------------------------------------------------------------------

    def _choose(self) -> tuple[Queued, float, float] | None:
        for level in self._levels:
            if not level.num_queued:
                continue
            best: tuple[float, int, Queued, float] | None = None
            for name, flow in level.flows.items():
                head = self._head(flow)
                if head is None:
                    continue
                start = flow.last_finish
                finish = start + head.cost / self._weights[name]
                if best is None or (finish, self._rank[name]) < (best[0], best[1]):
                    best = (finish, self._rank[name], head, start)
            finish, _, head, start = best
            return head, start, finish
        return None

    def _head(self, flow: _Flow) -> Queued | None:
        while flow.heap and not self._live(flow.heap[0]):
            heapq.heappop(flow.heap)
        return self._entries[flow.heap[0][3]] if flow.heap else None

    def _live(self, item: tuple[float, int, int, str]) -> bool:
        return self._push_ids.get(item[3]) == item[2]

    def _count(self, entry: Queued, level: _Level, flow: _Flow, sign: int) -> None:
        if sign > 0:
            self._entries[entry.request_id] = entry
        else:
            del self._entries[entry.request_id], self._push_ids[entry.request_id]
        flow.num_tokens += sign * entry.cost
        flow.num_queued += sign
        level.num_tokens += sign * entry.cost
        level.num_queued += sign
        self._num_per_tenant[entry.tenant] += sign

