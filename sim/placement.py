"""Where a prompt is computed: the seam through which routers are compared in simulated time.

``SimCluster`` asks its ``Placement`` for the replica of every prompt its
compute pool computes (the prefill pool; the decode pool when colocated).
A placement sees what a Serve request router sees:

- the prompt's chained block hashes and length, and its LoRA adapter (``Arrival``, as ``RouteHints``);
- each replica's load as last reported, and the report itself (``report``),
  every ``report_period_s``;
- the requests this ingress sent each replica that have not come back
  (``PoolView.in_flight``), which Serve's routers count themselves.

The app's own router is ``AffinityPlacement``; ``bench.router`` plugs in the
peers it is compared with.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from router.cache_feed import CacheEventFeed
from router.latency import LatencyPolicyConfig, PredictedLatencyPolicy
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad, RoutingReason
from router.prefix_index import PrefixIndex
from router.protocol import RoutingStats


@dataclass(frozen=True)
class Arrival:
    """One prompt to place, as its routing hints describe it."""

    request_id: str
    block_hashes: Sequence[bytes]  # chained, in the engines' block size, from the adapter's root
    num_prompt_tokens: int
    now_s: float
    adapter: str | None = None  # the LoRA adapter's name, where the ingress names it (None: the base model)


class PoolView(Protocol):
    """What a router may see of the pool it places into."""

    @property
    def replica_ids(self) -> list[str]: ...

    def loads(self) -> list[ReplicaLoad]:
        """Each replica's load as of its last report."""

    def in_flight(self, replica_id: str) -> int:
        """Requests sent to ``replica_id`` that have not come back."""


class Placement(Protocol):
    def place(self, arrival: Arrival, pool: PoolView) -> str:
        """The replica id that computes ``arrival``'s prompt (the request is sent there)."""

    def report(self, replica_id: str, stats: RoutingStats) -> None:
        """A replica's periodic ``RoutingStats``, as ``record_routing_stats`` publishes them."""


class AffinityPlacement:
    """The app's prefill router (``router.serve.PrefixAffinityRouter``): one policy per ingress replica.

    Each policy keeps its own prefix index, fed every replica's reports
    through its own ``CacheEventFeed``. With ``num_ingress`` > 1, requests
    reach the ingress replicas in turn and each learns only from its own
    decisions and the reports, as several ingress replicas of a Serve app do.
    """

    policy_class: type[PrefixAffinityPolicy] = PrefixAffinityPolicy

    def __init__(self, config: PolicyConfig, num_ingress: int = 1) -> None:
        if num_ingress < 1:
            raise ValueError(f"num_ingress must be >= 1, got {num_ingress}")
        self.policies = [self.policy_class(dataclasses.replace(config, seed=config.seed + i),
                                           PrefixIndex(config.index_max_blocks)) for i in range(num_ingress)]
        self._feeds = [CacheEventFeed(policy.index) for policy in self.policies]
        self._next = 0

    @property
    def reason_counts(self) -> Counter[RoutingReason]:
        return sum((policy.reason_counts for policy in self.policies), Counter())

    def place(self, arrival: Arrival, pool: PoolView) -> str:
        policy = self.policies[self._next]
        self._next = (self._next + 1) % len(self.policies)
        decision = policy.choose(arrival.block_hashes, arrival.num_prompt_tokens, pool.loads(), arrival.adapter)
        policy.record_routed(decision, arrival.block_hashes)
        return decision.replica_id

    def report(self, replica_id: str, stats: RoutingStats) -> None:
        for policy, feed in zip(self.policies, self._feeds):
            feed.apply(replica_id, stats)
            policy.reported(replica_id)


class LatencyPlacement(AffinityPlacement):
    """The app's predicted-latency prefill router (``router.latency``): one policy per ingress replica.

    ``clock`` is the simulated time, which the predictions are made in and reports arrive at.
    """

    policy_class = PredictedLatencyPolicy

    def __init__(self, config: LatencyPolicyConfig, clock: Callable[[], float], num_ingress: int = 1) -> None:
        super().__init__(config, num_ingress)
        self.clock = clock

    def place(self, arrival: Arrival, pool: PoolView) -> str:
        policy = self.policies[self._next]
        self._next = (self._next + 1) % len(self.policies)
        decision = policy.choose(arrival.block_hashes, arrival.num_prompt_tokens, pool.loads(), arrival.now_s,
                                 arrival.adapter)
        policy.record_routed(decision, arrival.block_hashes, arrival.now_s)
        return decision.replica_id

    def report(self, replica_id: str, stats: RoutingStats) -> None:
        now_s = self.clock()
        for policy, feed in zip(self.policies, self._feeds):
            feed.apply(replica_id, stats)
            policy.observe(replica_id, stats, now_s)
