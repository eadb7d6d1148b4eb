"""A whole deployment in simulated time: the ingress's decisions, both pools, their routers, KV transfers.

    submit ──> ingress: RemotePrefillRule (router.remote_prefill) on the decode pool's prefix index
                 │ remote                                   │ local
                 v                                          │
               PrefixAffinityPolicy ──> prefill replica     │
                 (pin_kv: first token, KVHandle, lease)     │
                 │ first token streams                      │
                 v                                          v
               DecodePolicy ──> decode replica (pulls the blocks it lacks, then decodes) ──> tokens

What decides is the project's own code: the rule, the routing policies fed
by the replicas' prefix-cache events every ``report_period_s`` (as Serve's
``record_routing_stats`` does), and real engines (``sim.engine``) whose
``KVConnector`` leases, pulls and releases over ``sim.transport``. What is
modelled: each engine step's time (``CostModel``), each read's time
(``TransferModel``), one Ray call's overhead each way (``call_s``) and the
ingress's own work on a request before it decides (``ingress_s``, on the
host's cores when it has a ``host``).
Serve's own queueing (``max_ongoing_requests``) is not: a replica admits
whatever is routed to it, and its scheduler queues it.

Where a prompt is computed can be another router (``sim.placement``), and
each pool's replicas can start, drain and stop while it runs (``sim.pool``).

A request may run under a LoRA adapter of the deployment's (``adapters``,
``sim.adapters``): the ingress hashes its prompt from the adapter's root,
names the adapter in its routing hints (unless ``adapter_hints`` is off:
adapter-blind routing) and asks both engines to run it under the adapter.

A ``Gate`` may stand before the ingress's decision (``sim.flow_gate``: the
app's flow control): it is told of every request once the ingress has done
its own work on it, of every report period and of every request finished,
and places a request (``release(True)``) or refuses it (``release(False)``:
nothing is computed and its record gets no token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from pd.config.app import AFFINITY_ROUTER, LATENCY_ROUTER, PREFILL_ROUTER
from pd.engine.outputs import RequestOutput
from pd.sampling_params import SamplingParams
from router.decode_policy import DecodePolicy, DecodePolicyConfig
from router.flow_config import FlowIdentity
from router.gray import GrayFailureConfig, GrayFailureDetector, Transition
from router.hashing import ROOT_HASH, hash_block_tokens
from router.latency import LatencyPolicyConfig, LatencyPredictor
from router.policy import PolicyConfig, RoutingDecision
from router.remote_prefill import PoolPredictions, RemotePrefillRule, predicted_remote
from router.shared import PoolRouting
from router.step_cost import prefill_pairs
from sim.adapters import AdapterCatalog, SimAdapter
from sim.clock import EventLoop
from sim.fast_forward import RunOutputs
from sim.host import HostModel, SharedHost
from sim.placement import AffinityPlacement, Arrival, LatencyPlacement, Placement
from sim.pool import PoolSpec, SimPool
from sim.replica import RequestRecord
from sim.tiers import ModelledStore, TierModels
from sim.transport import LINKS, SimNetwork, TransferModel

PREFILL_ROUTERS = (LATENCY_ROUTER, AFFINITY_ROUTER)  # the app's prefill routers the simulator runs, unmodified


@dataclass(frozen=True)
class ClusterSpec:
    """A deployment: ``prefill`` None is colocated (the decode pool prefills everything)."""

    decode: PoolSpec
    prefill: PoolSpec | None = None
    rule: RemotePrefillRule = RemotePrefillRule()  # with ``predicted``, the prefill router is the latency one
    prefill_router: str = PREFILL_ROUTER  # the prefill pool's: LATENCY_ROUTER or AFFINITY_ROUTER (pd.config.app)
    prefill_policy: dict = field(default_factory=dict)  # PolicyConfig fields beyond block_size
    decode_policy: dict = field(default_factory=dict)  # DecodePolicyConfig fields beyond block_size
    transfer: TransferModel = LINKS["loopback"]
    report_period_s: float = 1.0  # request_routing_stats_period_s
    call_s: float = 0.0  # one Ray call's overhead, each way
    ingress_s: float = 0.0  # from a request's arrival to the ingress's decision (parsing, template, tokens)
    host: HostModel | None = None  # every replica on one machine's cores (sim.host); None: each has its own
    tiers: TierModels = TierModels()  # the disk tier's and the shared store's I/O, for engines that have them
    seed: int = 0
    # The decode router's gray-failure detector (router.gray), judging at each report; None: off.
    gray_failure: GrayFailureConfig | None = None
    # LoRA adapters requests may run under (the pools' engines need enable_lora), and whether the ingress names
    # a request's adapter in its routing hints (False: the routers place it as if it had none).
    adapters: tuple[SimAdapter, ...] = ()
    adapter_hints: bool = True

    def __post_init__(self) -> None:
        if self.prefill_router not in PREFILL_ROUTERS:
            raise ValueError(f"prefill_router {self.prefill_router!r}: the simulator runs "
                             f"{' or '.join(PREFILL_ROUTERS)}")
        if self.prefill is not None and self.prefill.engine.block_size != self.decode.engine.block_size:
            raise ValueError("the prefill and decode pools need the same block_size")
        if self.adapters:
            for name, pool in (("decode", self.decode), ("prefill", self.prefill)):
                if pool is not None and not pool.engine.enable_lora:
                    raise ValueError(f"adapters are served by engines with enable_lora: the {name} pool's has not")

    @property
    def block_size(self) -> int:
        return self.decode.engine.block_size

    @property
    def num_replicas(self) -> int:
        return self.decode.num_replicas + (self.prefill.num_replicas if self.prefill else 0)


@dataclass
class _Flow:
    record: RequestRecord
    prompt: list[int]
    hashes: list[bytes]
    params: SamplingParams
    remote: bool = False
    adapter: str | None = None  # its LoRA adapter's name; None: the base model
    identity: FlowIdentity | None = None  # who sent it and how urgent it is, for a gate


class Gate(Protocol):
    """Admission before the ingress's decision (module docstring)."""

    def arrive(self, request_id: str, identity: FlowIdentity, block_hashes: Sequence[bytes], num_prompt_tokens: int,
               max_tokens: int, arrival_s: float, release: Callable[[bool], None]) -> None:
        """A request the ingress is about to place, which arrived at ``arrival_s``: ``release(True)`` places it,
        ``release(False)`` refuses it."""

    def reported(self) -> None:
        """The pools reported (every ``report_period_s``)."""

    def finished(self, request_id: str, num_output_tokens: int) -> None:
        """A placed request's last token streamed."""


class SimCluster:
    """``spec`` served in ``loop``'s time.

    ``placement`` chooses the replica that computes each prompt: in the
    prefill pool, or in the decode pool when colocated. None is the app's
    own routers (``AffinityPlacement`` for prefill, ``DecodePolicy`` for a
    colocated pool); ``bench.router`` passes the routers it compares.
    """

    def __init__(self, loop: EventLoop, spec: ClusterSpec, placement: Placement | None = None,
                 gate: Gate | None = None):
        self.loop = loop
        self.gate = gate
        self.spec = spec
        block_size = spec.block_size
        self.network = SimNetwork(loop, spec.transfer) if spec.prefill is not None else None
        self.host = SharedHost(loop, spec.host) if spec.host is not None else None
        self.shared_store = ModelledStore()  # the deployment's: every replica with a shared_kv_bucket reads it
        self.adapters = AdapterCatalog(spec.adapters)
        self.decode = SimPool("decode", spec.decode, loop, self.network, spec.seed, self._decode_outputs, self.host,
                              spec.tiers, self.shared_store, self.adapters)
        self.decode_policy = DecodePolicy(DecodePolicyConfig(block_size=block_size, seed=spec.seed,
                                                             **spec.decode_policy))
        self.decode_routing = PoolRouting()  # what the ingress asks of the decode pool's index
        self.decode_routing.share_index(self.decode.index, block_size)
        self.prefill = None
        if spec.prefill is not None:
            self.prefill = SimPool("prefill", spec.prefill, loop, self.network, spec.seed + 1, self._prefill_outputs,
                                   self.host, spec.tiers, self.shared_store, self.adapters)
            self.prefill.placement = placement or self._prefill_placement()
        else:
            self.decode.placement = placement
        # The decode router's predictor (the app's DecodeLoadRouter keeps one), fed by the pool's reports and,
        # here, told of each local prefill, which the app's router cannot tell from a decode call.
        decode_predictor = LatencyPredictor(self._latency_config(spec.decode, {}))
        self.decode_policy.predictor = decode_predictor
        # The predicted rule's views of the pools: the prefill router's predictor and the decode router's.
        self.rule_views: dict[str, PoolPredictions] = {}
        if self.prefill is not None and spec.rule.predicted:
            if not isinstance(self.prefill.placement, LatencyPlacement):
                raise ValueError("the predicted remote-prefill rule needs the predicted-latency prefill router")
            prefill, predictor = self.prefill, self.prefill.placement.policies[0].predictor
            self.rule_views = {"prefill": PoolPredictions(predictor, prefill.index, prefill.replica_ids),
                               "decode": PoolPredictions(decode_predictor, self.decode.index, self.decode.replica_ids)}
        self.gray = GrayFailureDetector(spec.gray_failure) if spec.gray_failure is not None else None
        self.gray_changes: list[Transition] = []  # what it decided, in order
        self.records: dict[str, RequestRecord] = {}
        self._flows: dict[str, _Flow] = {}
        self._reporting = False

    def _latency_config(self, pool: PoolSpec, fields: dict) -> LatencyPolicyConfig:
        return LatencyPolicyConfig(block_size=self.spec.block_size, seed=self.spec.seed,
                                   max_num_batched_tokens=pool.engine.max_num_batched_tokens, **fields)

    def _prefill_placement(self) -> Placement:
        """The app's prefill router (``spec.prefill_router``, the app's default unless named): the predicted-latency
        one, which the predicted rule needs, or the prefix-affinity one."""
        if self.spec.rule.predicted or self.spec.prefill_router == LATENCY_ROUTER:
            return LatencyPlacement(self._latency_config(self.spec.prefill, self.spec.prefill_policy), self.loop.time)
        return AffinityPlacement(PolicyConfig(block_size=self.spec.block_size, seed=self.spec.seed,
                                              **self.spec.prefill_policy))

    # The ingress ------------------------------------------------------------

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               adapter: str | None = None, identity: FlowIdentity | None = None) -> RequestRecord:
        """A request arrives at the ingress now, under LoRA ``adapter`` (a name in ``spec.adapters``) if given;
        ``identity``: its tenant's key or header, priority and deadline header, for the gate (none: the defaults)."""
        root = ROOT_HASH if adapter is None else self.adapters.key(adapter).root_hash
        record = RequestRecord(self.loop.now, len(prompt))
        self.records[request_id] = record
        flow = _Flow(record, prompt, hash_block_tokens(prompt, self.spec.block_size, parent_hash=root), params,
                     adapter=adapter, identity=identity)
        self._flows[request_id] = flow
        self._start_reports()
        if self.spec.ingress_s:
            self._ingress(request_id, flow)
        else:
            self._admit(request_id, flow)
        return record

    def _ingress(self, request_id: str, flow: _Flow) -> None:
        """``ingress_s`` of work before the decision: CPU on the cores the engines share, if they share them."""
        if self.host is None:
            self.loop.at(self.loop.now + self.spec.ingress_s, lambda: self._admit(request_id, flow))
            return
        key = f"ingress:{request_id}"
        stretch = self.host.begin(key, 1)

        def done() -> None:
            self.host.end(key)
            self._admit(request_id, flow)

        self.loop.at(self.loop.now + self.spec.ingress_s * stretch, done)

    def _admit(self, request_id: str, flow: _Flow) -> None:
        """Through the gate, if there is one: placed when it releases the request, dropped when it refuses it."""
        if self.gate is None:
            self._place(request_id, flow)
            return

        def release(admitted: bool) -> None:
            if admitted:
                self._place(request_id, flow)
            else:
                del self._flows[request_id]

        self.gate.arrive(request_id, flow.identity or FlowIdentity(), flow.hashes, len(flow.prompt),
                         flow.params.max_tokens, flow.record.arrival_s, release)

    def _place(self, request_id: str, flow: _Flow) -> None:
        """The ingress's decision: prefill remotely or on the decode replica."""
        if self.prefill is not None:
            flow.remote = self._wants_remote(flow)
        if flow.remote:
            self._send_prefill(request_id, flow)
        else:
            self._send_decode(request_id, flow)

    def _wants_remote(self, flow: _Flow) -> bool:
        """The rule: by predicted seconds once they have data (``predicted``), by the threshold until then."""
        prompt, rule = flow.prompt, self.spec.rule
        if self.rule_views:
            views = self.rule_views
            views["prefill"].replica_ids, views["decode"].replica_ids = self.prefill.replica_ids, self.decode.replica_ids
            remote = predicted_remote(rule, views["decode"], views["prefill"], flow.hashes, len(prompt),
                                      self.spec.block_size, 2 * self.spec.call_s, self.loop.now)
            if remote is not None:
                return remote
        uncached = self.decode_routing.estimate_uncached_tokens(flow.hashes, len(prompt))
        return rule.wants_remote(len(prompt), uncached, self.prefill.total_in_flight)

    def _arrival(self, request_id: str, flow: _Flow) -> Arrival:
        return Arrival(request_id, flow.hashes, len(flow.prompt), self.loop.now, self._hinted_adapter(flow))

    def _hinted_adapter(self, flow: _Flow) -> str | None:
        """The adapter the request's routing hints name."""
        return flow.adapter if self.spec.adapter_hints else None

    @staticmethod
    def _engine_options(flow: _Flow) -> dict:
        return {} if flow.adapter is None else {"lora": flow.adapter}

    def _send_prefill(self, request_id: str, flow: _Flow) -> None:
        pool = self.prefill
        replica_id = pool.placement.place(self._arrival(request_id, flow), pool)
        pool.sent(replica_id)
        replica = pool.replicas[replica_id]
        self.loop.at(self.loop.now + self.spec.call_s,
                     lambda: replica.add(request_id, flow.prompt, flow.params, pin_kv=True,
                                         **self._engine_options(flow)))

    def _prefill_outputs(self, replica_id: str, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self.loop.at(self.loop.now + self.spec.call_s,
                             lambda output=output: self._prefilled(replica_id, output))

    def _prefilled(self, replica_id: str, output: RequestOutput) -> None:
        """The prefill's answer is back: its first token streams, and the decode call goes out with the handle."""
        self.prefill.returned(replica_id)
        flow = self._flows[output.request_id]
        if output.kv_handle is None:  # a failed prefill pinned nothing: the decode replica prefills
            self._send_decode(output.request_id, flow)
            return
        flow.record.add(dataclasses.replace(output, finished=False), self.loop.now)
        if self.host is not None:
            self.host.note_tokens(1)
        if flow.params.max_tokens == 1:
            flow.record.finished_s = self.loop.now
            self.prefill.replicas[replica_id].engine.release_kv(output.request_id)  # nobody will pull it
            self._done(output.request_id)
            return
        self._send_decode(output.request_id, flow, kv_handle=output.kv_handle, first_token_id=output.new_token_ids[0])

    def _send_decode(self, request_id: str, flow: _Flow, kv_handle: bytes | None = None,
                     first_token_id: int | None = None) -> None:
        pool = self.decode
        if pool.placement is not None:
            replica_id = pool.placement.place(self._arrival(request_id, flow), pool)
        else:
            loads = pool.loads()
            if self.gray is not None:  # the quarantined take no new streams, as in the app's decode router
                allowed = set(self.gray.allowed([load.replica_id for load in loads]))
                loads = [load for load in loads if load.replica_id in allowed]
            adapter = self._hinted_adapter(flow)
            loads = self.decode_policy.candidates(pool.index, flow.hashes, loads, adapter)
            runs = pool.index.match_tiers(flow.hashes, [load.replica_id for load in loads])
            decision: RoutingDecision = self.decode_policy.choose(loads, runs, len(flow.prompt), adapter)
            self.decode_policy.record_routed(decision)
            replica_id = decision.replica_id
            if kv_handle is None:  # a local prefill: it queues there
                self.decode_policy.predictor.sent(
                    replica_id, decision.uncached_tokens, prefill_pairs(decision.uncached_tokens,
                                                                        decision.matched_tokens), self.loop.now)
        pool.sent(replica_id)
        replica = pool.replicas[replica_id]

        def call() -> None:
            options = self._engine_options(flow)
            if kv_handle is not None:
                lora = None if flow.adapter is None else self.adapters.key(flow.adapter)
                options["remote_kv"] = replica.engine.open_kv_handle(kv_handle, flow.prompt, lora)
                options["first_token_id"] = first_token_id
            replica.add(request_id, flow.prompt, flow.params, **options)

        self.loop.at(self.loop.now + self.spec.call_s, call)

    def _decode_outputs(self, replica_id: str, outputs: list[RequestOutput] | RunOutputs) -> None:
        # One event for the step's outputs: they were sent together, and nothing can come between them.
        self.loop.at(self.loop.now + self.spec.call_s, lambda: self._streamed(replica_id, outputs))

    def _streamed(self, replica_id: str, outputs: list[RequestOutput] | RunOutputs) -> None:
        if isinstance(outputs, RunOutputs):  # fast-forwarded steps (sim.fast_forward): no request finishes in them
            for request_id, times_s in outputs.token_times(self.spec.call_s):
                self._flows[request_id].record.token_times_s += times_s  # each token call_s after its step's end
            return
        for output in outputs:
            flow = self._flows[output.request_id]
            flow.record.add(output, self.loop.now)
            if self.host is not None:
                self.host.note_tokens(len(output.new_token_ids))
            if output.finished:
                self.decode.returned(replica_id)
                self._done(output.request_id)

    def _done(self, request_id: str) -> None:
        flow = self._flows.pop(request_id)
        if self.gate is not None:
            self.gate.finished(request_id, len(flow.record.token_times_s))

    # Reports ------------------------------------------------------------------

    def pools(self) -> list[SimPool]:
        return [pool for pool in (self.prefill, self.decode) if pool is not None]

    def _start_reports(self) -> None:
        if not self._reporting:
            self._reporting = True
            self.loop.at(self.loop.now + self.spec.report_period_s, self._report)

    def _report(self) -> None:
        for pool in self.pools():
            pool.report()
        predictor = self.decode_policy.predictor
        for replica_id, stats in self.decode.reports.items():
            predictor.observe(replica_id, stats, self.loop.now)
            self.decode_policy.reported(replica_id)
            if self.gray is not None:
                self.gray.observe(replica_id, stats, self.loop.now)
        if self.gray is not None:  # judged once a report period, as the app's routers judge once a second
            self.gray_changes += self.gray.update(self.decode.replica_ids, self.loop.now)
        if self.gate is not None:
            self.gate.reported()
        if self.loop.has_events():  # arrivals, steps or reads to come; with none, nothing can change
            self.loop.at(self.loop.now + self.spec.report_period_s, self._report)
        else:
            self._reporting = False

    def busy_s(self) -> dict[str, float]:
        """Each replica's modelled compute time so far."""
        return {replica_id: replica.busy_s for pool in self.pools() for replica_id, replica in pool.replicas.items()}
