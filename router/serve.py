"""Ray Serve request routers for the engine pools.

Every router here first honours the routing fields a ``PoolRequest`` carries
in the call's first argument: an explicit ``target_replica_id`` (the call must
reach that replica, or fail) and ``exclude_replica_ids`` (never those). The
remaining replicas are ranked by the router's policy.

Routers run in the caller's process, so ``routed_replica`` lets the caller
learn which replica a request went to (for example, to exclude it on retry).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica
from ray.util import metrics

from router.policy import (
    DecodePolicy,
    DecodePolicyConfig,
    PolicyConfig,
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoutingDecision,
    matched_tokens,
)
from router.prefix_index import PrefixIndex
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
    """Load from the replica's last routing stats: active requests plus KV usage."""
    state = replica_state(replica)
    return state.num_active_requests + 4.0 * state.kv_usage


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


# Decode routers' prefix indexes by deployment name, for the ingress in this process.
_decode_indexes: dict[str, tuple[PrefixIndex, int]] = {}


def estimate_uncached_tokens(deployment: str, block_hashes: list[bytes], num_prompt_tokens: int) -> int:
    """Prompt tokens the best-placed replica of a decode pool would have to compute itself.

    Read from the decode router's prefix index in this process; every token
    counts as uncached until that router has seen the pool.
    """
    entry = _decode_indexes.get(deployment)
    if entry is None or not block_hashes:
        return num_prompt_tokens
    index, block_size = entry
    matches = index.match(block_hashes)
    return num_prompt_tokens - matched_tokens(max(matches.values(), default=0), block_size, num_prompt_tokens)


def replica_state(replica: RunningReplica) -> ReplicaLoad:
    """A replica's reported load, as the policies take it."""
    stats = replica.routing_stats or {}
    return ReplicaLoad(
        replica_id=replica.replica_id.unique_id,
        queued_prefill_tokens=max(0, int(stats.get("num_waiting_tokens", 0))),
        num_active_requests=max(0, int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))),
        kv_usage=min(1.0, max(0.0, float(stats.get("kv_usage", 0.0)))),
    )


class _CacheEventFeed:
    """Applies replicas' numbered prefix-cache events to an index, each once, in order.

    A report lists events from ``cache_events_from`` on. When that is past the
    next event this feed expects, events were dropped before it read them; the
    replica's entries may be stale, so they are forgotten and rebuilt from
    what follows.
    """

    def __init__(self, index: PrefixIndex):
        self.index = index
        self._seen: dict[str, int] = {}
        self.num_gaps = 0

    def update(self, replicas: list[RunningReplica]) -> None:
        live = set()
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            live.add(replica_id)
            stats = replica.routing_stats or {}
            seen = self._seen.get(replica_id, -1)
            if seen >= 0 and int(stats.get("cache_events_from", 0)) > seen + 1:
                logger.info("replica %s: prefix-cache events %d.. were dropped; rebuilding its index entries",
                            replica_id, seen + 1)
                self.num_gaps += 1
                self.index.remove_replica(replica_id)
                seen = -1
            latest: dict[bytes, bool] = {}  # each hash's last state, so store-then-evict ends evicted
            for seq, block_hash, was_stored in stats.get("cache_events") or []:
                if seq > seen:
                    latest.pop(block_hash, None)
                    latest[block_hash] = bool(was_stored)
                    seen = seq
            evicted = [h for h, stored in latest.items() if not stored]
            if evicted:
                self.index.evict(replica_id, evicted)
            stored = [h for h, stored in latest.items() if stored]
            if stored:
                self.index.insert(replica_id, stored)
            self._seen[replica_id] = seen
        for gone in set(self._seen) - live:
            del self._seen[gone]
            self.index.remove_replica(gone)


class _DecisionMetrics:
    def __init__(self, pool: str):
        self.decisions = metrics.Counter(
            "pd_router_decisions_total", description="routing decisions by reason", tag_keys=("pool", "reason"),
        )
        self.decisions.set_default_tags({"pool": pool})

    def record(self, decision: RoutingDecision) -> None:
        self.decisions.inc(tags={"reason": decision.reason.value})


class PrefixAffinityRouter(PinnedRequestRouter):
    """Prefill placement: the replica most likely to hold the prompt's prefix, within load bounds.

    ``request_router_kwargs`` are ``router.policy.PolicyConfig`` fields.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = PrefixAffinityPolicy(PolicyConfig(**kwargs))
        self.feed = _CacheEventFeed(self.policy.index)
        self.metrics = _DecisionMetrics("prefill")
        self._decisions: OrderedDict[str, tuple[RoutingDecision, list[bytes]]] = OrderedDict()

    def rank(self, replicas: list[RunningReplica], fields: RoutingFields | None) -> list[list[RunningReplica]]:
        if fields is None:
            return super().rank(replicas, fields)
        self.feed.update(list(self.curr_replicas.values()))
        decision = self.policy.choose(fields.block_hashes, fields.num_tokens, [replica_state(r) for r in replicas])
        self._decisions[fields.request_id] = (decision, fields.block_hashes)
        while len(self._decisions) > _MAX_REMEMBERED:
            self._decisions.popitem(last=False)
        by_id = {r.replica_id.unique_id: r for r in replicas}
        order = [by_id[i] for i in decision.ranked_replica_ids if i in by_id] or [by_id[decision.replica_id]]
        return [[replica] for replica in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        fields = self._fields(pending_request)
        if fields is None or fields.request_id not in self._decisions:
            return
        decision, hashes = self._decisions.pop(fields.request_id)
        if decision.replica_id != replica_id.unique_id:
            decision = dataclasses.replace(decision, replica_id=replica_id.unique_id)
        self.policy.record_routed(decision, hashes)
        self.metrics.record(decision)


class DecodeLoadRouter(PinnedRequestRouter):
    """Decode placement: KV headroom and active decodes, plus a bonus for local prefix hits.

    ``request_router_kwargs`` are ``router.policy.DecodePolicyConfig`` fields.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = DecodePolicy(DecodePolicyConfig(**kwargs))
        self.index = PrefixIndex(max_blocks=1 << 20)
        self.feed = _CacheEventFeed(self.index)
        self.metrics = _DecisionMetrics("decode")
        _decode_indexes[self._deployment_id.name] = (self.index, self.policy.config.block_size)

    def rank(self, replicas: list[RunningReplica], fields: RoutingFields | None) -> list[list[RunningReplica]]:
        if fields is None:
            return super().rank(replicas, fields)
        self.feed.update(list(self.curr_replicas.values()))
        matches = self.index.match(fields.block_hashes)
        decision = self.policy.choose([replica_state(r) for r in replicas], matches, fields.num_tokens)
        self.policy.record_routed(decision)
        self.metrics.record(decision)
        by_id = {r.replica_id.unique_id: r for r in replicas}
        order = [by_id[i] for i in decision.ranked_replica_ids if i in by_id] or [by_id[decision.replica_id]]
        return [[replica] for replica in order]
