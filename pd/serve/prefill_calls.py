"""The prefill calls this ingress has in flight on each replica, for their deadlines.

A prefill call's deadline is a liveness bound (``AppArgs.prefill_deadline_s``): a call that passes it is
taken for a stuck or lost replica, retried elsewhere, then prefilled on the decode replica. A replica
computes its queue in order, so a call waits for the prompts placed on it before its own: eight 8k-token
prompts sent at once to one replica are a queue of minutes there, not eight failures. Each call's deadline
therefore counts the prompt tokens ahead of it on its replica as well as its own: those this ingress placed
there and has not had answered, or, where more, the replica's last report of its uncomputed prompt tokens
(what other ingress replicas placed is seen there).
"""

from __future__ import annotations

import asyncio

from pd.serve.protocol import PoolControl
from router.protocol import RouteHints
from router.shared import PoolRouting

# How long a retry waits for the failed attempt's lease release to go out (see release_before_retry).
RELEASE_BEFORE_RETRY_S = 1.0


async def awaited(response):
    """A Serve call's answer, as a coroutine (``asyncio.ensure_future`` and ``wait_for`` take it)."""
    return await response


class PrefillQueues:
    """Per prefill replica, the prompt tokens of this ingress's calls placed there and not yet answered."""

    def __init__(self) -> None:
        self._on: dict[str, dict[str, int]] = {}  # replica id -> call's request id -> its prompt tokens

    def place(self, replica_id: str, request_id: str, num_tokens: int, reported_waiting_tokens: int = 0) -> int:
        """Note a call placed on ``replica_id``; the prompt tokens queued there before it."""
        calls = self._on.setdefault(replica_id, {})
        ahead = max(sum(calls.values()), reported_waiting_tokens)
        calls[request_id] = num_tokens
        return ahead

    def done(self, replica_id: str, request_id: str) -> None:
        """The call was answered, failed or given up."""
        calls = self._on.get(replica_id)
        if calls is not None:
            calls.pop(request_id, None)
            if not calls:
                del self._on[replica_id]

    def tokens_on(self, replica_id: str) -> int:
        return sum(self._on.get(replica_id, {}).values())


def release(routing: PoolRouting, prefill, request_id: str, replica_id: str):
    """Send a prefill's lease release (its response, not awaited); None when the replica is gone with its
    leases."""
    if not routing.is_live(replica_id):
        return None
    hints = RouteHints(request_id=request_id, target_replica_id=replica_id)
    return prefill.release.remote(hints.encode(), PoolControl(request_id=request_id).encode())


async def release_before_retry(routing: PoolRouting, prefill, request_id: str, replica_id: str) -> None:
    """Release a failed attempt's lease, and let the call be placed before the retry's call is made.

    Calls made for one HTTP request share its Serve request context, and
    Serve's router indexes the calls it is still placing by the context's
    internal request id (Ray 2.60): a release and a retry in placement at
    once could swap replicas (the retry going to the replica it excludes)
    or leave one never placed. The wait is short: a lease the release
    misses expires by itself.
    """
    response = release(routing, prefill, request_id, replica_id)
    if response is None:
        return
    try:
        await asyncio.wait_for(awaited(response), RELEASE_BEFORE_RETRY_S)
    except Exception:  # noqa: BLE001 - timed out or failed: the lease expires by itself
        response.cancel()
