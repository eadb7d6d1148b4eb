"""Ray Serve request routers for the engine pools: thin adapters around ``router.policy``.

Every router here first honours the ``RouteHints`` a call carries as its
first argument: an explicit ``target_replica_id`` (the call must reach that
replica, or fail) and ``exclude_replica_ids`` (never those). The remaining
replicas are ranked by the router's policy, from the replicas' published
``RoutingStats``.

``request_router_kwargs`` are the policy's config fields; the app adds
``block_size`` (the engines') and ``routing_scope`` (``router.shared``), and
checks the rest against ``policy_config`` before ``serve run`` starts anything.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Iterable

from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica
from ray.util import metrics

from router.cache_feed import CacheEventFeed
from router.decode_policy import DecodePolicy, DecodePolicyConfig
from router.gray import GrayFailureConfig, GrayFailureDetector, probe_targets
from router.latency import LatencyPolicyConfig, LatencyPredictor, PredictedLatencyPolicy
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad, RoutingDecision
from router.prefix_index import PrefixIndex
from router.protocol import NO_STATS, ROUTING_STATS_KEY, RouteHints, RoutingStats, read_route_hints, replica_load
from router.shared import MAX_REMEMBERED, PoolRouting, RoutingScopes
from transfer.wire import WireError

logger = logging.getLogger(__name__)

JUDGE_PERIOD_S = 1.0  # how often a router's gray-failure detector judges its pool (reports come about as often)
PREDICTED_S_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def caller_pool_routing(scope: str) -> PoolRouting:
    """The pool routing the calling replica owns under ``scope`` (``router.shared``); else a private one."""
    try:
        owner = serve.get_replica_context().servable_object
    except Exception:  # noqa: BLE001 - not inside a replica (a driver, a test): nothing to share with
        owner = None
    scopes = getattr(owner, "routing_scopes", None)
    if scope and isinstance(scopes, RoutingScopes):
        return scopes.open(scope)
    return PoolRouting()


class ReplicaReports:
    """Each replica's latest ``RoutingStats``, decoded once per report; ``on_new`` hears of each new one."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[bytes, RoutingStats]] = {}
        self.on_new: Callable[[str, RoutingStats], None] = lambda replica_id, stats: None

    def get(self, replica: RunningReplica) -> RoutingStats:
        raw = (replica.routing_stats or {}).get(ROUTING_STATS_KEY)
        if raw is None:
            return NO_STATS
        replica_id = replica.replica_id.unique_id
        known = self._reports.get(replica_id)
        if known is not None and (known[0] is raw or known[0] == raw):
            return known[1]
        try:
            stats = RoutingStats.decode(raw)
        except WireError as exc:
            logger.warning("replica %s published unreadable routing stats: %s", replica_id, exc)
            stats = NO_STATS
        self._reports[replica_id] = (raw, stats)
        self.on_new(replica_id, stats)
        return stats

    def load(self, replica: RunningReplica) -> ReplicaLoad:
        """The replica's reported load, as the policies take it."""
        return replica_load(replica.replica_id.unique_id, self.get(replica))

    def retain(self, live_replica_ids: set[str]) -> None:
        for gone in set(self._reports) - live_replica_ids:
            del self._reports[gone]


class PinnedRequestRouter(RequestRouter):
    """Honours target and exclusions, then prefers the least-loaded of two random replicas."""

    policy_config: ClassVar[type | None] = None  # the config class its kwargs build, if any

    def initialize_state(self, routing_scope: str = "", gray_failure: dict[str, float] | None = None,
                         **policy_kwargs: Any) -> None:
        self.pool = caller_pool_routing(routing_scope)
        self.reports = ReplicaReports()
        self.initialize_policy(**policy_kwargs)
        self.gray = None if gray_failure is None else GrayFailureWatch(
            GrayFailureDetector(GrayFailureConfig(**gray_failure)), self.pool, routing_scope or "pool")
        if self.gray is not None:
            heard = self.reports.on_new
            self.reports.on_new = lambda replica_id, stats: (heard(replica_id, stats),
                                                             self.gray.detector.observe(replica_id, stats,
                                                                                        time.monotonic()))

    def initialize_policy(self, **policy_kwargs: Any) -> None:
        if policy_kwargs:
            raise TypeError(f"{type(self).__name__} takes no policy kwargs, got {sorted(policy_kwargs)}")

    def rank(self, replicas: list[RunningReplica], hints: RouteHints | None) -> list[list[RunningReplica]]:
        sample = list(replicas) if len(replicas) <= 2 else random.sample(replicas, 2)
        random.shuffle(sample)
        sample.sort(key=lambda replica: _load_score(self.reports.load(replica)))
        return [sample]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Back off between attempts when nothing we offer takes the request. Without this, Serve
            # retries at once, forever: one call pinned to a dead replica spins the router thread
            # that every call from this process shares.
            pending_request.routing_context.should_backoff = True
        hints = _hints(pending_request)
        if hints is None:
            return self.rank(candidate_replicas, None)
        if hints.target_replica_id is not None:
            # A target that is down: nothing to offer now; the caller's deadline decides when to give up.
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == hints.target_replica_id]
            return [chosen] if chosen else []
        excluded = set(hints.exclude_replica_ids)
        allowed = [r for r in candidate_replicas if r.replica_id.unique_id not in excluded]
        if self.gray is not None:
            allowed = self.gray.allowed(allowed, self.curr_replicas.values(), self.reports)
        if not allowed:
            return []
        ranks = self.rank(allowed, hints)
        if ranks and ranks[0]:  # where it goes unless that replica refuses; on_request_routed confirms
            self.pool.note_routed(hints.request_id, ranks[0][0].replica_id.unique_id)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        hints = _hints(pending_request)
        if hints is not None:
            self.pool.note_routed(hints.request_id, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new view of the pool, which it sends whenever a replica's report changes: each new report is
        read now (policies, predictor, detector), and the pool's reports go to the ingress's flow control, which
        must hear of them while it holds every request back and nothing is routed."""
        super().update_replicas(replicas)
        self.pool.set_replicas(replica.replica_id.unique_id for replica in replicas)
        reports = {replica.replica_id.unique_id: self.reports.get(replica) for replica in replicas}
        self.reports.retain(set(reports))
        self.pool.set_reports({replica_id: stats for replica_id, stats in reports.items() if stats is not NO_STATS})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.pool.mark_dead(replica_id.unique_id)

    def update_feed(self, feed: CacheEventFeed) -> None:
        """Bring ``feed``'s index up to the replicas' latest reports (cheap when nothing changed)."""
        replicas = list(self.curr_replicas.values())
        live = {replica.replica_id.unique_id for replica in replicas}
        for replica in replicas:
            feed.apply(replica.replica_id.unique_id, self.reports.get(replica))
        feed.retain(live)
        self.reports.retain(live)


class GrayFailureWatch:
    """A router's gray-failure detector (``router.gray``): judged at most once a second, shared with the ingress.

    The quarantine and each replica's last slowness reading go to the pool's
    routing in this process: the ingress moves a quarantined replica's
    streams, and probes the quarantined and the suspects
    (``router.gray.probe_targets`` of these two). Changes and new suspects go
    to the log and to metrics. A replica quarantined past ``replace_after_s``
    goes to the routing's ``replace_due``: the ingress asks it to fail its
    health check, and Serve replaces it (``pd.serve.probes``).
    """

    def __init__(self, detector: GrayFailureDetector, pool: PoolRouting, scope: str):
        self.detector = detector
        self.pool = pool
        self.scope = scope
        self._judged_s = -math.inf
        self._held = metrics.Gauge("pd_router_quarantined_replicas", tag_keys=("pool",),
                                   description="replicas held back as persistently slow (gray failures)")
        self._changes = metrics.Counter("pd_router_quarantine_changes_total", tag_keys=("pool", "kind"),
                                        description="replicas quarantined, readmitted, or due for replacement")
        self._suspected = metrics.Gauge("pd_router_suspect_replicas", tag_keys=("pool",),
                                        description="replicas measured slow but not quarantined: the ingress probes "
                                                    "them (gray failures)")
        self._suspects: set[str] = set()

    def allowed(self, allowed: list[RunningReplica], every: Iterable[RunningReplica],
                reports: ReplicaReports) -> list[RunningReplica]:
        now = time.monotonic()
        if now - self._judged_s >= JUDGE_PERIOD_S:
            self._judged_s = now
            replicas = list(every)
            for replica in replicas:
                reports.get(replica)  # every new report reaches the detector, not only the ranked replicas'
            for change in self.detector.update([r.replica_id.unique_id for r in replicas], now):
                logger.warning("%s replica %s %s (%.1fx the time the pool's step cost predicts)", self.scope,
                               change.replica_id, change.kind, change.slowness)
                self._changes.inc(tags={"pool": self.scope, "kind": change.kind})
                if change.kind == "replace":
                    self.pool.replace_due[change.replica_id] = (
                        f"persistently slow: {change.slowness:.1f}x the time the pool's step cost predicts, "
                        f"quarantined for {self.detector.config.replace_after_s:g} s")
            live = {r.replica_id.unique_id for r in replicas}
            self.pool.replace_due = {r: why for r, why in self.pool.replace_due.items() if r in live}
            self.pool.quarantined = frozenset(self.detector.quarantined())
            self.pool.slowness = {r: self.detector.slowness(r) for r in sorted(live)}
            self._note_suspects(set(probe_targets(self.pool.quarantined, self.pool.slowness)) - self.pool.quarantined)
            self._held.set(len(self.pool.quarantined), tags={"pool": self.scope})
        keep = set(self.detector.allowed([r.replica_id.unique_id for r in allowed]))
        return [r for r in allowed if r.replica_id.unique_id in keep]

    def _note_suspects(self, suspects: set[str]) -> None:
        for replica_id in sorted(suspects - self._suspects):
            logger.warning("%s replica %s suspect (%.1fx the time the pool's step cost predicts): the ingress "
                           "probes it", self.scope, replica_id, self.pool.slowness[replica_id])
        self._suspects = suspects
        self._suspected.set(len(suspects), tags={"pool": self.scope})


def _hints(pending_request: PendingRequest | None) -> RouteHints | None:
    if pending_request is None or not pending_request.args:
        return None
    return read_route_hints(pending_request.args[0])


def _load_score(load: ReplicaLoad) -> float:
    """Active requests plus KV usage, for the pinned router's pick of two."""
    return load.num_active_requests + 4.0 * load.kv_usage


def _ranked(replicas: list[RunningReplica], decision: RoutingDecision) -> list[list[RunningReplica]]:
    by_id = {r.replica_id.unique_id: r for r in replicas}
    order = [by_id[i] for i in decision.ranked_replica_ids if i in by_id] or [by_id[decision.replica_id]]
    return [[replica] for replica in order]


class _DecisionMetrics:
    def __init__(self, pool: str):
        self.decisions = metrics.Counter(
            "pd_router_decisions_total", description="routing decisions by reason", tag_keys=("pool", "reason"),
        )
        self.decisions.set_default_tags({"pool": pool})
        self.predicted = metrics.Histogram(
            "pd_router_predicted_ttft_seconds", description="the chosen replica's predicted time to first token",
            boundaries=PREDICTED_S_BOUNDARIES, tag_keys=("pool", "reason"),
        )
        self.predicted.set_default_tags({"pool": pool})

    def record(self, decision: RoutingDecision) -> None:
        self.decisions.inc(tags={"reason": decision.reason.value})
        if decision.predicted_s is not None:
            self.predicted.observe(decision.predicted_s, tags={"reason": decision.reason.value})


class PrefixAffinityRouter(PinnedRequestRouter):
    """Prefill placement: the replica most likely to hold the prompt's prefix, within load bounds."""

    policy_config = PolicyConfig

    def initialize_policy(self, **policy_kwargs: Any) -> None:
        config = PolicyConfig(**policy_kwargs)
        self.policy = PrefixAffinityPolicy(config)
        self.reports.on_new = lambda replica_id, stats: self.policy.reported(replica_id)
        self.feed = CacheEventFeed(self.policy.index)
        self.pool.share_index(self.policy.index, config.block_size)
        self.metrics = _DecisionMetrics("prefill")
        self._decisions: OrderedDict[str, tuple[RoutingDecision, tuple[bytes, ...]]] = OrderedDict()

    def rank(self, replicas: list[RunningReplica], hints: RouteHints | None) -> list[list[RunningReplica]]:
        if hints is None:
            return super().rank(replicas, hints)
        self.update_feed(self.feed)
        decision = self.decide(hints, [self.reports.load(r) for r in replicas])
        self._decisions[hints.request_id] = (decision, hints.block_hashes)
        while len(self._decisions) > MAX_REMEMBERED:
            self._decisions.popitem(last=False)
        return _ranked(replicas, decision)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        hints = _hints(pending_request)
        if hints is None or hints.request_id not in self._decisions:
            return
        decision, hashes = self._decisions.pop(hints.request_id)
        if decision.replica_id != replica_id.unique_id:
            decision = dataclasses.replace(decision, replica_id=replica_id.unique_id)
        self.record(decision, hashes)
        self.metrics.record(decision)
        self.pool.note_decision(hints.request_id, decision.reason.value, decision.matched_tokens)

    def decide(self, hints: RouteHints, loads: list[ReplicaLoad]) -> RoutingDecision:
        return self.policy.choose(hints.block_hashes, hints.num_prompt_tokens, loads, hints.adapter)

    def record(self, decision: RoutingDecision, hashes: tuple[bytes, ...]) -> None:
        self.policy.record_routed(decision, hashes)


class PredictedLatencyRouter(PrefixAffinityRouter):
    """Prefill placement by predicted time to first token (``router.latency``), within the same bounds.

    Its predictor is shared with the ingress (``router.shared``), whose
    predicted remote-prefill rule asks it what a remote prefill would take.
    """

    policy_config = LatencyPolicyConfig

    def initialize_policy(self, **policy_kwargs: Any) -> None:
        config = LatencyPolicyConfig(**policy_kwargs)
        self.policy = PredictedLatencyPolicy(config)
        self.reports.on_new = lambda replica_id, stats: self.policy.observe(replica_id, stats, time.monotonic())
        self.feed = CacheEventFeed(self.policy.index)
        self.pool.share_index(self.policy.index, config.block_size)
        self.pool.share_predictor(self.policy.predictor)
        self.metrics = _DecisionMetrics("prefill")
        self._decisions: OrderedDict[str, tuple[RoutingDecision, tuple[bytes, ...]]] = OrderedDict()

    def decide(self, hints: RouteHints, loads: list[ReplicaLoad]) -> RoutingDecision:
        return self.policy.choose(hints.block_hashes, hints.num_prompt_tokens, loads, time.monotonic(),
                                  hints.adapter)

    def record(self, decision: RoutingDecision, hashes: tuple[bytes, ...]) -> None:
        self.policy.record_routed(decision, hashes, time.monotonic())


class DecodeLoadRouter(PinnedRequestRouter):
    """Decode placement: KV headroom and active decodes, plus a bonus for local prefix hits."""

    policy_config = DecodePolicyConfig

    def initialize_policy(self, **policy_kwargs: Any) -> None:
        config = DecodePolicyConfig(**policy_kwargs)
        # Each replica's speed and decodes, for the policy's inter-token latency and the ingress's predicted
        # remote-prefill rule (what a local prefill would take).
        self.predictor = LatencyPredictor(LatencyPolicyConfig(
            block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens))
        self.policy = DecodePolicy(config, self.predictor)
        self.index = PrefixIndex(max_blocks=config.index_max_blocks)
        self.feed = CacheEventFeed(self.index)
        self.pool.share_index(self.index, config.block_size)
        self.reports.on_new = self._heard
        self.pool.share_predictor(self.predictor)
        self.metrics = _DecisionMetrics("decode")

    def _heard(self, replica_id: str, stats: RoutingStats) -> None:
        """A new report: the predictor's speeds and decodes, and the adapters the replica holds."""
        self.predictor.observe(replica_id, stats, time.monotonic())
        self.policy.reported(replica_id)

    def rank(self, replicas: list[RunningReplica], hints: RouteHints | None) -> list[list[RunningReplica]]:
        if hints is None:
            return super().rank(replicas, hints)
        self.update_feed(self.feed)
        loads = self.policy.candidates(self.index, hints.block_hashes, [self.reports.load(r) for r in replicas],
                                       hints.adapter)
        runs = self.index.match_tiers(hints.block_hashes, [load.replica_id for load in loads])
        decision = self.policy.choose(loads, runs, hints.num_prompt_tokens, hints.adapter)
        self.policy.record_routed(decision)
        self.metrics.record(decision)
        self.pool.note_decision(hints.request_id, decision.reason.value, decision.matched_tokens)
        return _ranked(replicas, decision)
