"""Trace-driven comparison of prefill routers, in the cluster simulator (``sim``).

``python -m bench.router [--trace FILE | --generate {multi_tenant,system_prompt,mooncake,long_history,
flash_crowd,long_short}] [--replicas 8]
[--cache-blocks 256]`` serves one Mooncake-format trace (``pd.workload.trace``) with
every policy and prints one JSON line per policy:

- ``pd``: this project's default prefill router (``pd.config.app.PREFILL_ROUTER``):
  today ``latency``;
- ``latency``: ``router.latency.PredictedLatencyPolicy``, the prompt where
  its first token is predicted soonest;
- ``affinity``: ``router.policy.PrefixAffinityPolicy``, prefix hits against
  load under a balance bound (the default before ``latency``);
  each fed the replicas' own ``RoutingStats`` every report period, as in the app;
- ``round_robin``;
- ``pow2``: two random replicas, the one with fewer requests in flight;
- ``ray_prefix``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` decision logic
  over Ray's own ``PrefixTree`` with Ray's defaults (match threshold 0.1,
  imbalance threshold infinite, smallest-tenant fallback). Each engine block
  is fed to the tree as a fixed-length string (``bench.ray_prefix``).

The pool is the simulator's (``sim.cluster``), the same for every policy: a
colocated pool of ``--replicas`` real ``LLMEngine``s (prefix caching,
chunked prefill, batching, preemption) whose steps cost what the analytic
profile of ``--model`` on ``--hardware`` says (``sim.hardware``). Each
replica's KV pool holds ``--cache-blocks`` of the trace's 512-token blocks:
its prefix cache, and the KV of the requests it runs. Arrivals come
``--time-scale`` times faster than the trace says.

Fields: ``hit_rate`` (prompt tokens the engines found cached over all prompt
tokens), ``max_min_load_ratio`` (most over fewest requests routed to a replica;
null when some replica got none), ``ttft_p50_s``/``ttft_p99_s`` (simulated),
``utilization`` (the replicas' modelled compute time over their time),
``decide_us_p50``/``decide_us_p99`` (wall time of one routing decision plus
the router's bookkeeping for it, measured here), and the per-replica request counts.
Percentiles interpolate between ranks, as ``pd.workload.stats`` defines them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from dataclasses import dataclass

from bench.baseline_routers import PowerOfTwo, RoundRobin
from bench.ray_prefix import RayPrefixRouter
from bench.router_traces import FlashCrowdTraceConfig, LongShortTraceConfig, generate_flash_crowd, generate_long_short
from pd.config import EngineConfig
from pd.config.app import LATENCY_ROUTER, PREFILL_ROUTER
from pd.model.config import load_model_config
from pd.workload.stats import percentile, percentiles
from pd.workload.trace import (
    MOONCAKE_LIKE,
    TRACE_BLOCK_TOKENS,
    LongHistoryTraceConfig,
    MultiTenantTraceConfig,
    SystemPromptTraceConfig,
    TraceRequest,
    dump_trace,
    generate_long_history,
    generate_multi_tenant,
    generate_system_prompt,
    load_trace,
)
from router.latency import LatencyPolicyConfig
from router.policy import PolicyConfig
from router.protocol import RoutingStats
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.hardware import HARDWARE, MODELS, Efficiency, analytic_cost, kv_bytes_per_token, model_dir
from sim.placement import AffinityPlacement, Arrival, LatencyPlacement, Placement, PoolView
from sim.scale import utilization
from sim.workload import submit_trace

POLICIES = ("pd", "latency", "affinity", "round_robin", "pow2", "ray_prefix")
DEFAULT_REPORT_INTERVAL_S = 1.0


def resolve_policy(policy: str) -> str:
    """``pd``, the app's default prefill router, as the policy it is; any other name as it is."""
    if policy != "pd":
        return policy
    return "latency" if PREFILL_ROUTER == LATENCY_ROUTER else "affinity"


@dataclass(frozen=True)
class ReplayConfig:
    """The simulated pool: size, KV per replica, the profile its steps cost, arrivals' speed, report period."""

    num_replicas: int = 8
    cache_blocks: int = 256  # KV per replica, in the trace's 512-token blocks
    model: str = "llama-3-8b"
    hardware: str = "h200"
    block_size: int = 64
    max_num_batched_tokens: int = 8192
    time_scale: float = 1.0
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S
    num_ingress: int = 1  # pd and latency: ingress replicas, each with its own router
    seed: int = 0

    def cluster_spec(self) -> ClusterSpec:
        path = model_dir(self.model)
        config = load_model_config(path)
        engine = EngineConfig(model=path, dtype="bfloat16", block_size=self.block_size,
                              kv_cache_bytes=self.cache_blocks * TRACE_BLOCK_TOKENS * kv_bytes_per_token(config),
                              max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=256)
        cost = analytic_cost(config, HARDWARE[self.hardware], Efficiency())
        return ClusterSpec(decode=PoolSpec(self.num_replicas, engine, cost),
                           report_period_s=self.report_interval_s, call_s=0.001, seed=self.seed)


class Timed:
    """A placement whose decisions are timed on the wall clock.

    The garbage collector is paused while one runs: the simulator around the
    router allocates far more than a router process does, and a collection it
    set off would be charged to whichever decision ran into it.
    """

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.decide_ns: list[int] = []

    def place(self, arrival: Arrival, pool: PoolView) -> str:
        gc.disable()
        try:
            started_ns = time.perf_counter_ns()
            replica_id = self.placement.place(arrival, pool)
            self.decide_ns.append(time.perf_counter_ns() - started_ns)
        finally:
            gc.enable()
        return replica_id

    def report(self, replica_id: str, stats: RoutingStats) -> None:
        self.placement.report(replica_id, stats)


def make_placement(policy: str, config: ReplayConfig, pd_config: PolicyConfig, loop: EventLoop) -> Placement:
    policy = resolve_policy(policy)
    if policy == "affinity":
        return AffinityPlacement(pd_config, config.num_ingress)
    if policy == "latency":
        latency_config = LatencyPolicyConfig(**{**vars(pd_config), "num_ingress": config.num_ingress,
                                                "max_num_batched_tokens": config.max_num_batched_tokens,
                                                "decodes_here": True})  # the pool is colocated
        return LatencyPlacement(latency_config, loop.time, config.num_ingress)
    if policy == "round_robin":
        return RoundRobin()
    if policy == "pow2":
        return PowerOfTwo(config.seed)
    if policy == "ray_prefix":
        return RayPrefixRouter(config.seed)
    raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    hit_rate: float
    max_min_load_ratio: float | None
    ttft_p50_s: float
    ttft_p99_s: float
    utilization: float
    decide_us_p50: float
    decide_us_p99: float
    routed_per_replica: list[int]
    extra: dict

    def to_json(self, **context) -> str:
        record = {"policy": self.policy, **context, "hit_rate": round(self.hit_rate, 4),
                  "max_min_load_ratio": None if self.max_min_load_ratio is None else round(self.max_min_load_ratio, 3),
                  "ttft_p50_s": round(self.ttft_p50_s, 4), "ttft_p99_s": round(self.ttft_p99_s, 4),
                  "utilization": round(self.utilization, 3), "decide_us_p50": round(self.decide_us_p50, 1),
                  "decide_us_p99": round(self.decide_us_p99, 1),
                  "routed_per_replica": self.routed_per_replica, **self.extra}
        return json.dumps(record)


def replay(policy: str, trace: list[TraceRequest], config: ReplayConfig, pd_config: PolicyConfig) -> PolicyResult:
    """Serve ``trace`` in the simulator, every prompt placed by ``policy``."""
    loop = EventLoop()
    placement = make_placement(policy, config, pd_config, loop)
    timed = Timed(placement)
    cluster = SimCluster(loop, config.cluster_spec(), timed)
    submit_trace(cluster, trace, time_scale=config.time_scale)
    cluster.loop.run()
    records = list(cluster.records.values())
    ttft_p50_s, ttft_p99_s = percentiles([record.ttft_s for record in records], [50, 99])
    routed = [cluster.decode.num_routed[replica_id] for replica_id in cluster.decode.replica_ids]
    extra = {}
    if isinstance(placement, AffinityPlacement):
        extra["reasons"] = {reason.value: count for reason, count in sorted(placement.reason_counts.items())}
    return PolicyResult(
        policy=policy,
        hit_rate=sum(r.num_cached_tokens for r in records) / max(1, sum(r.num_prompt_tokens for r in records)),
        max_min_load_ratio=max(routed) / min(routed) if min(routed) > 0 else None,
        ttft_p50_s=ttft_p50_s,
        ttft_p99_s=ttft_p99_s,
        utilization=utilization(cluster),
        decide_us_p50=percentile(timed.decide_ns, 50) / 1000.0,
        decide_us_p99=percentile(timed.decide_ns, 99) / 1000.0,
        routed_per_replica=routed,
        extra=extra,
    )


GENERATORS = ("multi_tenant", "system_prompt", "mooncake", "long_history", "flash_crowd", "long_short")


def build_trace(args: argparse.Namespace) -> tuple[str, list[TraceRequest]]:
    if args.trace:
        return args.trace, load_trace(args.trace)
    if args.generate in ("flash_crowd", "long_short"):
        preset = FlashCrowdTraceConfig() if args.generate == "flash_crowd" else LongShortTraceConfig()
        generate = generate_flash_crowd if args.generate == "flash_crowd" else generate_long_short
        config = dataclasses.replace(preset, num_requests=args.requests or preset.num_requests,
                                     rate_per_s=args.rate or preset.rate_per_s, seed=args.seed)
        return args.generate, generate(config)
    if args.generate == "system_prompt":
        config = SystemPromptTraceConfig(num_requests=args.requests or SystemPromptTraceConfig.num_requests,
                                         rate_per_s=args.rate or SystemPromptTraceConfig.rate_per_s, seed=args.seed)
        return "system_prompt", generate_system_prompt(config)
    if args.generate == "long_history":
        config = LongHistoryTraceConfig(num_requests=args.requests or LongHistoryTraceConfig.num_requests,
                                        rate_per_s=args.rate or LongHistoryTraceConfig.rate_per_s, seed=args.seed)
        return "long_history", generate_long_history(config)
    preset = MOONCAKE_LIKE if args.generate == "mooncake" else MultiTenantTraceConfig()
    config = dataclasses.replace(preset, num_requests=args.requests or preset.num_requests,
                                 rate_per_s=args.rate or preset.rate_per_s, seed=args.seed)
    return args.generate, generate_multi_tenant(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", help="Mooncake-format JSONL trace to replay")
    source.add_argument("--generate", choices=GENERATORS, default="multi_tenant",
                        help="built-in trace generator, used when no --trace is given")
    parser.add_argument("--requests", type=int, default=0, help="generated requests (0: the generator's default)")
    parser.add_argument("--rate", type=float, default=0.0, help="generated arrivals per second (0: the generator's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator, the engines and the random policies")
    parser.add_argument("--replicas", type=int, default=8, help="replicas in the pool")
    parser.add_argument("--cache-blocks", type=int, default=256, help="KV per replica, in 512-token blocks")
    parser.add_argument("--model", default="llama-3-8b", help=f"a preset ({', '.join(MODELS)}) or a model directory")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    parser.add_argument("--block-size", type=int, default=64, help="the engines' block size, in tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrivals come this many times faster")
    parser.add_argument("--report-interval", type=float, default=DEFAULT_REPORT_INTERVAL_S,
                        help="seconds between the replicas' routing-stats reports")
    parser.add_argument("--ingress", type=int, default=1,
                        help="ingress replicas, each with its own pd router (requests reach them in turn)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    parser.add_argument("--save-trace", help="also write the replayed trace to this JSONL file")
    args = parser.parse_args(argv)

    trace_name, trace = build_trace(args)
    if args.save_trace:
        dump_trace(trace, args.save_trace)
    config = ReplayConfig(num_replicas=args.replicas, cache_blocks=args.cache_blocks, model=args.model,
                          hardware=args.hardware, block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens, time_scale=args.time_scale,
                          report_interval_s=args.report_interval, num_ingress=args.ingress, seed=args.seed)
    pd_config = PolicyConfig(block_size=args.block_size, seed=args.seed)
    for policy in args.policies.split(","):
        result = replay(policy.strip(), trace, config, pd_config)
        print(result.to_json(trace=trace_name, replicas=args.replicas, requests=len(trace)), flush=True)


if __name__ == "__main__":
    main()
