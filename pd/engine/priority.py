"""Requests kept in priority order: vLLM's ``priority`` (lower is more urgent, 0 by default).

The scheduler's waiting queue and running list are both in this order, and
within a priority in the order they had without one. So admission takes the
most urgent waiting request first, a step's token budget goes to the most
urgent running requests first, and preemption, which takes the last running
request, takes the least urgent (the newest of them). A step that computes a
prompt chunk of some priority takes no chunk of a less urgent prompt
(``most_urgent_prompt``): a step's time grows with its tokens. With every
request at one priority, nothing changes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import MutableSequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pd.engine.outputs import ScheduledRequest
    from pd.engine.request import Request


def _priority(request: Request) -> int:
    return request.priority


def enqueue(requests: MutableSequence[Request], request: Request) -> None:
    """Put ``request`` behind every request of its priority or a more urgent one."""
    insort(requests, request, key=_priority)


def requeue(requests: MutableSequence[Request], request: Request) -> None:
    """Put ``request`` ahead of the others of its priority (a request preempted, or sent back to compute)."""
    requests.insert(bisect_left(requests, request.priority, key=_priority), request)


def most_urgent_prompt(scheduled: list[ScheduledRequest], urgent: int | None) -> int | None:
    """``urgent``, or the priority of a more urgent prompt chunk (over one token, no draft) in ``scheduled``."""
    for item in scheduled:
        if item.num_new_tokens > 1 and not item.draft_token_ids and (urgent is None or item.request.priority < urgent):
            urgent = item.request.priority
    return urgent
