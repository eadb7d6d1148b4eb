"""One pool of simulated replicas: who serves, who starts, who drains, and what the routers see of them.

A replica's life, as under a Serve autoscaler:

    add ──(startup_s)──> serving ──retire──> draining ──(no request, lease or pull left)──> stopped

Only serving replicas are routed to (``replica_ids``, ``loads``). A draining
replica finishes what it holds, and a prefill replica keeps serving KV pulls
until its leases are released or expire; it stops at the first report period
after that. Replica-seconds count from ``add`` to stop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from pd.config import EngineConfig
from pd.engine.outputs import RequestOutput
from router.cache_feed import CacheEventFeed
from router.policy import ReplicaLoad
from router.prefix_index import PrefixIndex
from router.protocol import NO_STATS, RoutingStats, replica_load
from sim.adapters import NO_ADAPTERS, AdapterCatalog
from sim.clock import EventLoop
from sim.cost import CostModel
from sim.engine import routing_stats, sim_engine
from sim.host import SharedHost
from sim.placement import Placement
from sim.replica import SimReplica
from sim.tiers import ModelledStore, TierModels
from sim.transport import SimNetwork


@dataclass(frozen=True)
class PoolSpec:
    num_replicas: int
    engine: EngineConfig
    cost: CostModel
    threads: int = 1  # compute threads per replica (what a shared host counts)
    # The cost of a step on ``engine.decode_threads`` (pd.engine.model_runner.step_threads); None: ``cost``.
    decode_cost: CostModel | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"a pool needs at least one replica, got {self.num_replicas}")


class SimPool:
    """One pool's replicas, their latest reports, and the routing knowledge fed from them (a ``PoolView``)."""

    def __init__(self, name: str, spec: PoolSpec, loop: EventLoop, network: SimNetwork | None, seed: int,
                 on_outputs: Callable[[str, list[RequestOutput]], None], host: SharedHost | None,
                 tier_models: TierModels = TierModels(), shared_store: ModelledStore | None = None,
                 adapters: AdapterCatalog = NO_ADAPTERS):
        self.name = name
        self._adapters = adapters  # the deployment's LoRA adapters, for engines with enable_lora
        self._tier_models = tier_models
        self._shared_store = shared_store  # the deployment's (sim.tiers), for engines with a shared_kv_bucket
        self.spec = spec
        self.loop = loop
        self._network = network
        self._seed = seed
        self._on_outputs = on_outputs
        self._host = host
        self.replicas: dict[str, SimReplica] = {}  # every replica there has been, stopped ones too
        self._serving: dict[str, None] = {}  # routable, in the order they came
        self._starting: dict[str, None] = {}  # in the order they were added
        self._draining: set[str] = set()
        self._lifetimes: dict[str, list] = {}  # replica id -> [added at, stopped at or None]
        self.reports: dict[str, RoutingStats] = {}
        self._last_seq: dict[str, int] = {}
        self._loads: list[ReplicaLoad] = []
        self.index = PrefixIndex(max_blocks=1 << 20)
        self.feed = CacheEventFeed(self.index)
        self.placement: Placement | None = None  # also told every report
        self.num_in_flight: Counter[str] = Counter()  # sent by the ingress, not yet back
        self.total_in_flight = 0
        self.num_routed: Counter[str] = Counter()
        for _ in range(spec.num_replicas):
            self.add(startup_s=0.0)

    # Membership -----------------------------------------------------------------

    @property
    def replica_ids(self) -> list[str]:
        """The replicas serving now: what a router may choose from."""
        return list(self._serving)

    @property
    def num_target(self) -> int:
        """Replicas serving or starting: the count an autoscaler has set."""
        return len(self._serving) + len(self._starting)

    def add(self, startup_s: float) -> str:
        """A new replica, serving after ``startup_s``."""
        index = len(self.replicas)
        replica_id = f"{self.name}-{index}"
        network, loop = self._network, self.loop
        transport = network.transport(replica_id, on_event=lambda: None) if network else None
        engine = sim_engine(self.spec.engine, self.spec.cost, seed=self._seed * 100_003 + index,
                            transport=transport, loop=loop, tier_models=self._tier_models,
                            shared_store=self._shared_store, decode_cost=self.spec.decode_cost,
                            adapters=self._adapters)
        replica = SimReplica(loop, engine, replica_id, host=self._host, threads=self.spec.threads,
                             on_outputs=lambda outputs: self._on_outputs(replica_id, outputs))
        if transport is not None:
            transport.on_event = replica.wake
        self.replicas[replica_id] = replica
        self._lifetimes[replica_id] = [loop.now, None]
        self.reports[replica_id] = NO_STATS
        if startup_s <= 0:
            self._serve(replica_id)
        else:
            self._starting[replica_id] = None
            loop.at(loop.now + startup_s, lambda: self._serve(replica_id))
        return replica_id

    def _serve(self, replica_id: str) -> None:
        if self._lifetimes[replica_id][1] is not None:
            return  # retired while starting
        self._starting.pop(replica_id, None)
        self._serving[replica_id] = None
        self._loads = [*self._loads, replica_load(replica_id, NO_STATS)]

    def retire(self, replica_id: str) -> None:
        """No new requests for ``replica_id``; it stops once it holds nothing (a starting one stops now)."""
        if replica_id in self._starting:
            del self._starting[replica_id]
            self._stop(replica_id)
            return
        if replica_id not in self._serving:
            raise ValueError(f"replica {replica_id!r} is not serving (draining or stopped already, or unknown)")
        del self._serving[replica_id]
        self._draining.add(replica_id)
        self._loads = [load for load in self._loads if load.replica_id != replica_id]
        self.reap()

    def retire_newest_starting_or_least_busy(self) -> str:
        """Retire one replica: a starting one if any, else the serving one with the fewest requests in flight."""
        if self._starting:
            replica_id = next(reversed(self._starting))
        else:
            replica_id = min(self._serving, key=lambda r: (self.num_in_flight[r], r))
        self.retire(replica_id)
        return replica_id

    def reap(self) -> None:
        """Stop the draining replicas that hold no request, lease or pull any more."""
        for replica_id in list(self._draining):
            engine = self.replicas[replica_id].engine
            if (self.num_in_flight[replica_id] == 0 and not engine.has_unfinished_requests()
                    and not engine.has_pending_transfers()):
                self._draining.discard(replica_id)
                self._stop(replica_id)

    def stopped_at(self, replica_id: str) -> float | None:
        return self._lifetimes[replica_id][1]

    def _stop(self, replica_id: str) -> None:
        self._lifetimes[replica_id][1] = self.loop.now
        self.reports.pop(replica_id, None)
        self.feed.retain(self.live_ids())

    def live_ids(self) -> list[str]:
        """Replicas that have not stopped: serving, starting or draining."""
        return [r for r, (_, stopped) in self._lifetimes.items() if stopped is None]

    def replica_seconds(self, until_s: float | None = None) -> float:
        """Replica time from each replica's ``add`` to its stop, up to ``until_s`` (default: now)."""
        end = self.loop.now if until_s is None else until_s
        return sum(max(0.0, min(end, stopped if stopped is not None else end) - added)
                   for added, stopped in self._lifetimes.values())

    # Routing --------------------------------------------------------------------

    def in_flight(self, replica_id: str) -> int:
        return self.num_in_flight[replica_id]

    def sent(self, replica_id: str) -> None:
        self.num_in_flight[replica_id] += 1
        self.total_in_flight += 1
        self.num_routed[replica_id] += 1

    def returned(self, replica_id: str) -> None:
        self.num_in_flight[replica_id] -= 1
        self.total_in_flight -= 1
        if replica_id in self._draining:
            self.reap()

    def report(self) -> None:
        """Every running replica publishes its ``RoutingStats``; the routers' feed applies them.

        A replica sends only the events after the last it sent (the one feed
        here has applied the rest): the same events a full window would bring
        it, without re-reading the window every period.
        """
        self.reap()
        for replica_id in self.live_ids():
            if replica_id in self._starting:
                continue
            stats = routing_stats(self.replicas[replica_id].engine, after_seq=self._last_seq.get(replica_id))
            if stats.last_seq is not None:
                self._last_seq[replica_id] = stats.last_seq
            self.reports[replica_id] = stats
            self.feed.apply(replica_id, stats)
            if self.placement is not None:
                self.placement.report(replica_id, stats)
        self._loads = [replica_load(replica_id, self.reports[replica_id]) for replica_id in self._serving]

    def loads(self) -> list[ReplicaLoad]:
        """Each serving replica's load as of its last report (what a router sees between reports)."""
        return self._loads

    @property
    def num_adapter_loads(self) -> int:
        """LoRA adapters copied into device slots, over every replica there has been."""
        return sum(replica.engine.runner.num_adapter_loads for replica in self.replicas.values())
