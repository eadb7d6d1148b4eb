"""Ray Serve request routers for the engine pools.

Every router here first honours the routing fields a ``PoolRequest`` carries
in the call's first argument: an explicit ``target_replica_id`` (the call must
reach that replica, or fail) and ``exclude_replica_ids`` (never those). The
remaining replicas are ranked by the router's policy.

Routers run in the caller's process, so ``routed_replica`` lets the caller
learn which replica a request went to (for example, to exclude it on retry).
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from router.requests import RoutingFields, routing_fields

logger = logging.getLogger(__name__)

_MAX_REMEMBERED = 4096
_routed: OrderedDict[str, str] = OrderedDict()


def routed_replica(request_id: str) -> str | None:
    """The replica id the last call for ``request_id`` was routed to, in this process."""
    return _routed.get(request_id)


def _remember(request_id: str, replica_id: str) -> None:
    _routed[request_id] = replica_id
    _routed.move_to_end(request_id)
    while len(_routed) > _MAX_REMEMBERED:
        _routed.popitem(last=False)


def replica_load(replica: RunningReplica) -> float:
    """Load from the replica's last routing stats: queued tokens, requests and KV usage."""
    stats = replica.routing_stats or {}
    return (
        float(stats.get("num_running", 0))
        + float(stats.get("num_waiting", 0))
        + float(stats.get("kv_usage", 0.0)) * 4.0
    )


class PinnedRequestRouter(RequestRouter):
    """Honours target and exclusions, then prefers the least-loaded of two random replicas."""

    def _fields(self, pending_request: PendingRequest | None) -> RoutingFields | None:
        if pending_request is None or not pending_request.args:
            return None
        return routing_fields(pending_request.args[0])

    def pinned_candidates(
        self, candidate_replicas: list[RunningReplica], fields: RoutingFields | None
    ) -> list[RunningReplica] | None:
        """The candidates the request allows, or None when it names a target that is not up."""
        if fields is None:
            return candidate_replicas
        if fields.target_replica_id is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == fields.target_replica_id]
            return chosen or None
        excluded = set(fields.exclude_replica_ids)
        return [r for r in candidate_replicas if r.replica_id.unique_id not in excluded]

    def rank(self, replicas: list[RunningReplica], fields: RoutingFields | None) -> list[list[RunningReplica]]:
        if len(replicas) <= 2:
            sample = list(replicas)
        else:
            sample = random.sample(replicas, 2)
        random.shuffle(sample)
        sample.sort(key=replica_load)
        return [sample]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        fields = self._fields(pending_request)
        allowed = self.pinned_candidates(candidate_replicas, fields)
        if not allowed:
            # A target that is down, or every replica excluded: nothing to offer now;
            # the caller's deadline decides when to give up.
            return []
        if fields is not None and fields.target_replica_id is not None:
            return [allowed]
        return self.rank(allowed, fields)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        fields = self._fields(pending_request)
        if fields is not None:
            _remember(fields.request_id, replica_id.unique_id)
