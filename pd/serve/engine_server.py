"""What the prefill and decode deployments share: an async engine, its transport, stats."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Callable

import torch
from ray import serve

from autoscale.serve import LatencyWindow, replica_metrics
from pd.config.app import AppArgs
from pd.engine.async_engine import AsyncLLMEngine
from pd.engine.timings import EngineTimings
from pd.lora.registry import UnknownAdapter
from pd.serve.metrics import ReplicaMetrics
from pd.serve.protocol import LoraRef, PoolRequest, ReplicaReplacement
from pd.serve.tracing import EngineTracer, tracer_provider
from transfer import KVTransport, create_transport

logger = logging.getLogger(__name__)

DEFAULT_LATENCY_WINDOW_S = 10.0


def resident_bytes() -> int:
    """This process's resident memory."""
    import psutil

    return psutil.Process().memory_info().rss


def current_replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


def make_transport(
    args: AppArgs, role: str, replica_id: str, control: Callable[[str, bytes], bytes] | None
) -> KVTransport | None:
    """The replica's KV transport; named after the replica so peers can reach it by id."""
    if args.mode == "colocated":
        return None
    if args.transfer_backend == "torch":
        import ray

        options: dict[str, Any] = {"role": role, "host": ray.util.get_node_ip_address()}
        if role == "decode":
            options["control"] = control
        else:
            options["port"] = args.torch_store_port
        return create_transport("torch", replica_id, **options)
    if args.ucx_net_devices is not None:
        # UCX reads this when the agent creates its context: its TCP listeners bind only these devices.
        os.environ["UCX_NET_DEVICES"] = args.ucx_net_devices
    return create_transport("nixl", replica_id)


def cgroup_cpu_limit() -> float | None:
    """The CPUs a cgroup v2 quota lets this process use (``cpu.max``), or None without one."""
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def replica_threads(assigned_cpus: float | None) -> int:
    """Compute threads for an engine that Ray assigned ``assigned_cpus``.

    Ray sets ``OMP_NUM_THREADS`` to the floor of a worker's CPUs, and to 1
    below one, so a replica with ``num_cpus: 1.5`` would compute on one
    thread. The engine takes the assignment rounded up instead, capped by the
    cores the process may run on (its affinity) and by a cgroup CPU quota.
    """
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    wanted = math.ceil(assigned_cpus) if assigned_cpus else 1
    return max(1, min(cores, wanted))


def replica_decode_threads(assigned_cpus: float | None) -> int:
    """Threads for a replica's steps of few tokens: ``replica_threads`` of the CPUs it holds whole.

    A fraction of a core left over belongs to the processes beside the replica
    (its ingress, Serve's proxy). A small decode step is a hundred short
    parallel regions, and every region waits for a thread that one of them has
    preempted. Served alone on two cores with ``num_cpus: 1.5``, one stream's
    inter-token latency went from 6.5-7.2 ms on two threads to 4.9-5.6 on one
    (AMD EPYC); prefill chunks keep the rounded-up count.
    """
    return replica_threads(math.floor(assigned_cpus) if assigned_cpus and assigned_cpus >= 1 else None)


class EngineServer:
    """An ``AsyncLLMEngine`` inside a Serve replica."""

    role = "engine"

    def __init__(self, args: dict, control: Callable[[str, bytes], bytes] | None = None):
        self.args = AppArgs.model_validate(args)
        self.replica_id = current_replica_id()
        self.transport = make_transport(self.args, self.role, self.replica_id, control)
        config = self.args.engine_config(self.role)
        if config.num_threads is None and config.device == "cpu":
            import ray

            assigned = ray.get_runtime_context().get_assigned_resources().get("CPU")
            config = dataclasses.replace(config, num_threads=replica_threads(assigned),
                                         decode_threads=config.decode_threads or replica_decode_threads(assigned))
        logger.info("%s replica computes on %s threads (%s for steps of few tokens)", self.role,
                    config.num_threads or "the default", config.decode_threads or "as many")
        launcher = None
        if config.num_ranks > 1:
            from pd.serve.tp_launcher import RayLauncher

            launcher = RayLauncher()
        self.engine = AsyncLLMEngine(config, self.transport, launcher=launcher)
        # Serve counts the replica started when this returns: no request pays for a first step's costs.
        self.engine.warm_up()
        self.metrics = ReplicaMetrics(self.role, self.replica_id)
        provider = tracer_provider(self.args.otlp_traces_endpoint,
                                   **{"service.instance.id": self.replica_id, "pd.role": self.role})
        self.tracer = None if provider is None else EngineTracer(provider, self.role, self.args.transfer_backend)
        pool = getattr(self.args, self.role, None)
        planner = getattr(pool, "autoscaling", None)
        # What the SLO planner reads (``record_autoscaling_stats``), over its period.
        self.latency_window = LatencyWindow(planner.period_s if planner else DEFAULT_LATENCY_WINDOW_S)
        self.num_prefilled = 0
        self.num_reports = 0  # RoutingStats.seq of the last report
        self.replacement_reason = ""  # set when the ingress asks Serve to replace this replica (a gray failure)
        logger.info("%s replica %s ready", self.role, self.replica_id)

    def _record_spans(self, request: PoolRequest, started_ns: int, arrived_ns: int, timings: EngineTimings | None,
              error: str = "", **attributes: object) -> None:
        """Export this call's spans under the ingress's (``request.traceparent``), when tracing is on."""
        if self.tracer is None or not request.traceparent:
            return
        try:
            self.tracer.record(request.traceparent, started_ns, arrived_ns, timings, error,
                               replica=self.replica_id, request_id=request.request_id,
                               num_prompt_tokens=len(request.token_ids), **attributes)
        except Exception:  # noqa: BLE001 - a tracing failure never fails the request
            logger.exception("request %s: its spans could not be recorded", request.request_id)

    async def _adapter(self, request: PoolRequest) -> str | None:
        """The name of the LoRA adapter ``request`` runs under, its weights loaded here first if this replica
        holds other weights under that name or none; ``ValueError`` naming why it cannot be."""
        ref = request.lora
        if ref is None:
            return None
        await self.engine.ensure_lora(ref.name, ref.path, ref.digest)
        return ref.name

    async def load_lora_of(self, hints: bytes, data: bytes) -> dict[str, Any]:
        """Load the adapter an encoded ``LoraRef`` names on the replica ``hints`` target (the router pins it)."""
        ref = LoraRef.decode(data)
        await self.engine.ensure_lora(ref.name, ref.path, ref.digest)
        return {"replica_id": self.replica_id, "loaded": True}

    async def unload_lora_of(self, hints: bytes, data: bytes) -> dict[str, Any]:
        """Unload the adapter an encoded ``LoraRef`` names here; its running requests finish on it."""
        ref = LoraRef.decode(data)
        try:
            running = await self.engine.unload_lora(ref.name)
        except UnknownAdapter:
            return {"replica_id": self.replica_id, "loaded": False, "num_running": 0}
        return {"replica_id": self.replica_id, "loaded": True, "num_running": running}

    def record_routing_stats(self) -> dict[str, bytes]:
        """Reaches this deployment's request routers as ``replica.routing_stats`` (``RoutingStats``)."""
        self.metrics.record_state(self.engine.stats())
        self.metrics.record_experts(self.engine.expert_stats())
        self.num_reports += 1
        return self.engine.routing_stats().replace(seq=self.num_reports).publish()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica (``autoscale.serve.replica_metrics``)."""
        ttft = self.latency_window if self.role == "prefill" else None
        itl = self.latency_window if self.role == "decode" else None
        return replica_metrics(self.engine.stats(), self.num_prefilled, ttft, itl)

    async def stats(self) -> dict[str, Any]:
        """Engine counters, the replica id and its node, for tests and operators."""
        import ray

        return {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "rss_bytes": resident_bytes(),
            "num_threads": torch.get_num_threads(),
            "tp_ranks": self.engine.tp_ranks(),
            **dataclasses.asdict(self.engine.stats()),
        }

    async def stats_of(self, hints: bytes) -> dict[str, Any]:
        """``stats`` of the replica encoded ``RouteHints`` target (the router pins it)."""
        return await self.stats()

    async def rebalance_experts(self) -> None:
        """Rebalance this replica's expert placement now (EPLB), one MoE layer per step from the next."""
        self.engine.rebalance_experts()

    async def expert_stats(self) -> dict[str, Any]:
        """Balancedness and loads per MoE layer, and the weight moves' times (``LLMEngine.expert_stats``)."""
        return self.engine.expert_stats()

    async def request_replacement(self, hints: bytes, data: bytes) -> None:
        """Fail every health check from now on (an encoded ``ReplicaReplacement``): Serve replaces this replica."""
        self.replacement_reason = ReplicaReplacement.decode(data).reason
        logger.warning("%s replica %s asked to be replaced (%s): failing its health checks", self.role,
                       self.replica_id, self.replacement_reason)

    async def check_health(self) -> None:
        if self.replacement_reason:
            raise RuntimeError(f"{self.role} replica {self.replica_id} is to be replaced: {self.replacement_reason}")
        self.engine.check_health()

    def __del__(self) -> None:  # Serve calls this when it stops the replica
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # the tiers' queued writes finish, the disk slot is given up, TP workers stop
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()
        tracer = getattr(self, "tracer", None)
        if tracer is not None:
            tracer.shutdown()  # the spans it holds go out
