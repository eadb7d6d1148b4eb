"""Trace-driven comparison of prefill routers on a modelled replica pool.

``python -m bench.router [--trace FILE | --generate {multi_tenant,system_prompt}] [--replicas 8]
[--cache-blocks 256]`` replays one Mooncake-format trace (``bench.trace``)
through every policy and prints one JSON line per policy:

- ``pd``: this project's ``router.policy.PrefixAffinityPolicy``, which also
  learns from the modelled replicas' stored/evicted block reports;
- ``round_robin``;
- ``pow2``: two random replicas, the one with fewer active requests;
- ``ray_prefix``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` decision logic
  over Ray's own ``PrefixTree`` with Ray's defaults (match threshold 0.1,
  imbalance threshold infinite, smallest-tenant fallback). Each hash id is
  fed to the tree as a fixed-length synthesized string (``bench.ray_prefix``).

Replay model, the same for every policy (``bench.replica_model``):

- each replica has an LRU prefix cache of ``--cache-blocks`` 512-token blocks.
  A request reuses the leading run of its ``hash_ids`` that its replica's cache
  holds when it is routed; its blocks are cached from then on (the replica is
  FIFO, so every later request on it runs after this one's prefill);
- each replica serves one request at a time, FIFO. A request occupies it for
  ``a + b * uncached_prompt_tokens + c * output_length`` seconds and its first
  token comes ``a + b * uncached_prompt_tokens`` after it starts; TTFT adds the
  wait in the queue;
- routers see the queues exactly: active requests, queued prefill tokens, and
  KV usage (the running request's blocks over the cache size).

Fields: ``hit_rate`` (cached prompt blocks over all prompt blocks, at routing
time), ``max_min_load_ratio`` (most over fewest requests routed to a replica;
null when some replica got none), ``ttft_p50_s``/``ttft_p99_s`` (modelled),
``decide_us_p99`` (wall time of one routing decision plus the router's
bookkeeping for it, measured here), and the per-replica request counts.
Percentiles interpolate between ranks, as ``bench.stats`` defines them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter
from dataclasses import dataclass

from bench.baseline_routers import PowerOfTwo, RoundRobin, Router, replica_name
from bench.ray_prefix import RayPrefixRouter
from bench.replica_model import PoolView, ReplicaCache, ReplicaQueue, block_key
from bench.stats import percentile, percentiles
from bench.trace import (
    TRACE_BLOCK_TOKENS,
    MultiTenantTraceConfig,
    SystemPromptTraceConfig,
    TraceRequest,
    dump_trace,
    generate_multi_tenant,
    generate_system_prompt,
    load_trace,
)
from router.cache_feed import CacheEventFeed
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad
from router.protocol import NO_STATS, RoutingStats

POLICIES = ("pd", "round_robin", "pow2", "ray_prefix")
DEFAULT_COST_A_S = 0.010  # fixed per-request overhead
DEFAULT_COST_B_S = 1e-4  # per uncached prompt token: 10k tokens/s of prefill
DEFAULT_COST_C_S = 2e-4  # per output token, what one request's decode steps cost the replica
DEFAULT_REPORT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ReplayConfig:
    """The modelled pool: size, cache, per-request cost ``a + b * uncached + c * output``, report period."""

    num_replicas: int = 8
    cache_blocks: int = 256
    cost_a_s: float = DEFAULT_COST_A_S
    cost_b_s: float = DEFAULT_COST_B_S
    cost_c_s: float = DEFAULT_COST_C_S
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S
    num_ingress: int = 1  # pd only: ingress replicas, each with its own router
    seed: int = 0


class PdRouter:
    """``PrefixAffinityPolicy``, fed the queues' loads and the caches' periodic reports.

    As in ``router.serve.PrefixAffinityRouter``: every decision first brings
    the policy's index up to the replicas' latest reports through a
    ``CacheEventFeed``, then chooses; both are timed.

    With ``num_ingress`` > 1 there is one policy per ingress replica, as in a
    Serve app with several ingress replicas: requests reach them in turn, each
    learns only from its own decisions and from the replicas' reports (which
    every one of them receives).
    """

    def __init__(self, config: PolicyConfig, num_replicas: int, num_ingress: int = 1) -> None:
        self.policies = [PrefixAffinityPolicy(dataclasses.replace(config, seed=config.seed + i))
                         for i in range(num_ingress)]
        self.feeds = [CacheEventFeed(policy.index) for policy in self.policies]
        self._next = 0
        self._names = [replica_name(replica) for replica in range(num_replicas)]
        self._replica_by_name = {name: replica for replica, name in enumerate(self._names)}
        self._reports = {name: NO_STATS for name in self._names}

    @property
    def reason_counts(self) -> Counter:
        return sum((policy.reason_counts for policy in self.policies), Counter())

    def prepare(self, request: TraceRequest, pool: PoolView) -> tuple[list[bytes], int, list[ReplicaLoad]]:
        loads = [
            ReplicaLoad(name, queue.queued_prefill_tokens(pool.now_s), len(queue.jobs),
                        queue.kv_usage(pool.now_s, pool.cache_blocks))
            for name, queue in zip(self._names, pool.queues)
        ]
        return [block_key(h) for h in request.hash_ids], request.input_length, loads

    def route(self, prepared: tuple[list[bytes], int, list[ReplicaLoad]], pool: PoolView) -> int:
        block_hashes, num_tokens, loads = prepared
        policy, feed = self.policies[self._next], self.feeds[self._next]
        self._next = (self._next + 1) % len(self.policies)
        for name, stats in self._reports.items():
            feed.apply(name, stats)
        decision = policy.choose(block_hashes, num_tokens, loads)
        policy.record_routed(decision, block_hashes)
        return self._replica_by_name[decision.replica_id]

    def report(self, replica: int, stats: RoutingStats) -> None:
        self._reports[self._names[replica]] = stats


def make_router(policy: str, config: ReplayConfig, pd_config: PolicyConfig) -> Router:
    if policy == "pd":
        return PdRouter(pd_config, config.num_replicas, config.num_ingress)
    if policy == "round_robin":
        return RoundRobin(config.num_replicas)
    if policy == "pow2":
        return PowerOfTwo(config.num_replicas, config.seed)
    if policy == "ray_prefix":
        return RayPrefixRouter(config.num_replicas, config.seed)
    raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    hit_rate: float
    max_min_load_ratio: float | None
    ttft_p50_s: float
    ttft_p99_s: float
    decide_us_p99: float
    routed_per_replica: list[int]
    extra: dict

    def to_json(self, **context) -> str:
        record = {"policy": self.policy, **context, "hit_rate": round(self.hit_rate, 4),
                  "max_min_load_ratio": None if self.max_min_load_ratio is None else round(self.max_min_load_ratio, 3),
                  "ttft_p50_s": round(self.ttft_p50_s, 4), "ttft_p99_s": round(self.ttft_p99_s, 4),
                  "decide_us_p99": round(self.decide_us_p99, 1), "routed_per_replica": self.routed_per_replica,
                  **self.extra}
        return json.dumps(record)


def replay(policy: str, trace: list[TraceRequest], config: ReplayConfig, pd_config: PolicyConfig) -> PolicyResult:
    """Route every request of ``trace`` with ``policy`` through the modelled pool."""
    router = make_router(policy, config, pd_config)
    queues = [ReplicaQueue() for _ in range(config.num_replicas)]
    caches = [ReplicaCache(config.cache_blocks) for _ in range(config.num_replicas)]
    next_report_s = config.report_interval_s
    cached_blocks = total_blocks = 0
    ttfts: list[float] = []
    decide_ns: list[int] = []
    for request in trace:
        now_s = request.timestamp_ms / 1000.0
        for queue in queues:
            queue.retire(now_s)
        while now_s >= next_report_s:
            for replica, cache in enumerate(caches):
                router.report(replica, cache.report())
            next_report_s += config.report_interval_s
        pool = PoolView(now_s, queues, config.cache_blocks)
        prepared = router.prepare(request, pool)
        started_ns = time.perf_counter_ns()
        replica = router.route(prepared, pool)
        decide_ns.append(time.perf_counter_ns() - started_ns)

        num_cached = caches[replica].match(request.hash_ids)
        caches[replica].insert(request.hash_ids)
        cached_blocks += num_cached
        total_blocks += len(request.hash_ids)
        uncached = max(1, request.input_length - num_cached * TRACE_BLOCK_TOKENS)
        prefill_s = config.cost_a_s + config.cost_b_s * uncached
        decode_s = config.cost_c_s * request.output_length
        ttfts.append(queues[replica].submit(now_s, prefill_s, decode_s, uncached, len(request.hash_ids)))

    routed = [queue.num_routed for queue in queues]
    ttft_p50_s, ttft_p99_s = percentiles(ttfts, [50, 99])
    extra = {}
    if isinstance(router, PdRouter):
        extra["reasons"] = {reason.value: count for reason, count in sorted(router.reason_counts.items())}
    return PolicyResult(
        policy=policy,
        hit_rate=cached_blocks / total_blocks if total_blocks else 0.0,
        max_min_load_ratio=max(routed) / min(routed) if min(routed) > 0 else None,
        ttft_p50_s=ttft_p50_s,
        ttft_p99_s=ttft_p99_s,
        decide_us_p99=percentile(decide_ns, 99) / 1000.0,
        routed_per_replica=routed,
        extra=extra,
    )


def build_trace(args: argparse.Namespace) -> tuple[str, list[TraceRequest]]:
    if args.trace:
        return args.trace, load_trace(args.trace)
    if args.generate == "system_prompt":
        config = SystemPromptTraceConfig(num_requests=args.requests or SystemPromptTraceConfig.num_requests,
                                         rate_per_s=args.rate or SystemPromptTraceConfig.rate_per_s, seed=args.seed)
        return "system_prompt", generate_system_prompt(config)
    config = MultiTenantTraceConfig(num_requests=args.requests or MultiTenantTraceConfig.num_requests,
                                    rate_per_s=args.rate or MultiTenantTraceConfig.rate_per_s, seed=args.seed)
    return "multi_tenant", generate_multi_tenant(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", help="Mooncake-format JSONL trace to replay")
    source.add_argument("--generate", choices=("multi_tenant", "system_prompt"), default="multi_tenant",
                        help="built-in trace generator, used when no --trace is given")
    parser.add_argument("--requests", type=int, default=0, help="generated requests (0: the generator's default)")
    parser.add_argument("--rate", type=float, default=0.0, help="generated arrivals per second (0: the generator's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator and of the random policies")
    parser.add_argument("--replicas", type=int, default=8, help="replicas in the modelled pool")
    parser.add_argument("--cache-blocks", type=int, default=256, help="prefix-cache capacity per replica, in 512-token blocks")
    parser.add_argument("--cost-a", type=float, default=DEFAULT_COST_A_S, help="a: seconds per request")
    parser.add_argument("--cost-b", type=float, default=DEFAULT_COST_B_S, help="b: seconds per uncached prompt token")
    parser.add_argument("--cost-c", type=float, default=DEFAULT_COST_C_S, help="c: seconds per output token")
    parser.add_argument("--report-interval", type=float, default=DEFAULT_REPORT_INTERVAL_S,
                        help="seconds between the replicas' stored/evicted block reports to the pd router")
    parser.add_argument("--ingress", type=int, default=1,
                        help="ingress replicas, each with its own pd router (requests reach them in turn)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    parser.add_argument("--save-trace", help="also write the replayed trace to this JSONL file")
    args = parser.parse_args(argv)

    trace_name, trace = build_trace(args)
    if args.save_trace:
        dump_trace(trace, args.save_trace)
    config = ReplayConfig(num_replicas=args.replicas, cache_blocks=args.cache_blocks, cost_a_s=args.cost_a,
                          cost_b_s=args.cost_b, cost_c_s=args.cost_c, report_interval_s=args.report_interval,
                          num_ingress=args.ingress,
                          seed=args.seed)
    pd_config = PolicyConfig(block_size=TRACE_BLOCK_TOKENS, seed=args.seed)
    for policy in args.policies.split(","):
        result = replay(policy.strip(), trace, config, pd_config)
        print(result.to_json(trace=trace_name, replicas=args.replicas, requests=len(trace)), flush=True)


if __name__ == "__main__":
    main()
