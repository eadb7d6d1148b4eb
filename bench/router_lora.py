"""Adapter-aware against adapter-blind routing of a multi-LoRA trace, in the cluster simulator (``sim``).

``python -m bench.router_lora [--adapters 16] [--zipf 1.0] [--replicas 8] [--max-loras 4]
[--policies affinity,latency]``
serves one trace (``sim.lora_trace``: each request under one of ``--adapters``
LoRA adapters drawn with Zipf popularity, its adapter's system prompt plus its
own tail) with each policy twice, and prints one JSON line per run:

- ``aware``: the ingress names each request's adapter in its routing hints,
  and the policy prices a replica that does not hold it (``router.adapters``);
- ``blind``: the same policy, the same block hashes (chained from the
  adapter's root, as the engines hash them), hints without the adapter.

Policies: ``affinity`` (``router.policy.PrefixAffinityPolicy``), ``latency``
(``router.latency.PredictedLatencyPolicy``), ``pd`` (the app's default prefill
router: ``latency``) and ``decode``
(``router.decode_policy.DecodePolicy`` placing a colocated pool, as the app's
decode router does).

The default trace has each adapter's 1,024-token system prompt ahead of a
512-4,096-token document, 50 requests a second over 8 replicas of 65,536 KV
tokens: the prefix caches cannot keep every adapter's system prompt beside
the documents, so where a request goes decides what stays cached. Where they
can (``--system-prompt-tokens 2048 --tail-tokens 64,512``), prefix affinity
alone keeps each adapter on few replicas, and ``affinity`` routes the same either way.

The pool is the simulator's (``sim.cluster``): ``--replicas`` real
``LLMEngine``s with ``enable_lora`` (the real scheduler admits at most
``--max-loras`` adapters among its running requests; before each step the
engine's own ``SlotTable`` gives the step's adapters slots, each load costing
a rank-``--lora-rank`` adapter's bytes over the host link), whose steps cost
what the analytic profile of ``--model`` on ``--hardware`` says. Each
replica's KV pool holds ``--kv-tokens`` tokens: its prefix cache, and the KV
of the requests it runs.

Fields: ``hit_rate`` (prompt tokens the engines found cached over all prompt
tokens), ``adapter_loads`` (adapters copied into device slots, all replicas),
``max_min_load_ratio`` (most over fewest requests routed to a replica; null
when some replica got none), ``ttft_p50_s``/``ttft_p99_s`` (simulated),
``utilization`` (the replicas' modelled compute time over their time), and
the per-replica request counts. Percentiles interpolate between ranks, as
``pd.workload.stats`` defines them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from bench.router import resolve_policy
from pd.config import EngineConfig
from pd.model.config import load_model_config
from pd.workload.stats import percentiles
from router.latency import LatencyPolicyConfig
from router.policy import PolicyConfig
from sim.adapters import lora_bytes
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.hardware import HARDWARE, MODELS, Efficiency, analytic_cost, kv_bytes_per_token, model_dir
from sim.lora_trace import LoraTraceConfig, generate_lora_trace, submit_lora_trace, trace_adapters
from sim.placement import AffinityPlacement, LatencyPlacement, Placement
from sim.scale import utilization

POLICIES = ("pd", "latency", "affinity", "decode")  # pd: the app's default prefill router (bench.router)
ROUTINGS = ("aware", "blind")


@dataclass(frozen=True)
class LoraReplayConfig:
    """The simulated pool: size, adapter slots, KV per replica, the profile its steps cost, report period."""

    num_replicas: int = 8
    max_loras: int = 4
    lora_rank: int = 16
    kv_tokens: int = 65536  # KV per replica, in tokens
    model: str = "llama-3-8b"
    hardware: str = "h200"
    block_size: int = 64
    max_num_batched_tokens: int = 8192
    report_interval_s: float = 1.0
    seed: int = 0

    def cluster_spec(self, trace: LoraTraceConfig, adapter_hints: bool) -> ClusterSpec:
        path = model_dir(self.model)
        config = load_model_config(path)
        engine = EngineConfig(model=path, dtype="bfloat16", block_size=self.block_size,
                              kv_cache_bytes=self.kv_tokens * kv_bytes_per_token(config),
                              max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=256,
                              enable_lora=True, max_loras=self.max_loras, max_lora_rank=self.lora_rank,
                              max_cpu_loras=trace.num_adapters)
        cost = analytic_cost(config, HARDWARE[self.hardware], Efficiency())
        return ClusterSpec(decode=PoolSpec(self.num_replicas, engine, cost), report_period_s=self.report_interval_s,
                           call_s=0.001, seed=self.seed, adapters=trace_adapters(trace, lora_bytes(config, self.lora_rank)),
                           adapter_hints=adapter_hints)


def make_placement(policy: str, config: LoraReplayConfig, loop: EventLoop) -> Placement | None:
    """The compute pool's router; None: the cluster's own decode policy places the colocated pool."""
    policy = resolve_policy(policy)
    if policy == "affinity":
        return AffinityPlacement(PolicyConfig(block_size=config.block_size, seed=config.seed))
    if policy == "latency":
        return LatencyPlacement(LatencyPolicyConfig(block_size=config.block_size, seed=config.seed,
                                                    max_num_batched_tokens=config.max_num_batched_tokens), loop.time)
    if policy == "decode":
        return None
    raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


def replay(policy: str, routing: str, trace: LoraTraceConfig, config: LoraReplayConfig) -> dict:
    """Serve ``trace`` in the simulator, each request placed by ``policy``, ``routing`` aware of adapters or not."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; expected one of {', '.join(ROUTINGS)}")
    loop = EventLoop()
    spec = config.cluster_spec(trace, adapter_hints=routing == "aware")
    cluster = SimCluster(loop, spec, make_placement(policy, config, loop))
    vocab_size = load_model_config(spec.decode.engine.model).vocab_size
    submit_lora_trace(cluster, generate_lora_trace(trace, vocab_size))
    loop.run()
    records = list(cluster.records.values())
    ttft_p50_s, ttft_p99_s = percentiles([record.ttft_s for record in records], [50, 99])
    routed = [cluster.decode.num_routed[replica_id] for replica_id in cluster.decode.replica_ids]
    return {
        "policy": policy, "routing": routing,
        "hit_rate": round(sum(r.num_cached_tokens for r in records) / max(1, sum(r.num_prompt_tokens for r in records)),
                          4),
        "adapter_loads": cluster.decode.num_adapter_loads,
        "max_min_load_ratio": round(max(routed) / min(routed), 3) if min(routed) > 0 else None,
        "ttft_p50_s": round(ttft_p50_s, 4), "ttft_p99_s": round(ttft_p99_s, 4),
        "utilization": round(utilization(cluster), 3),
        "routed_per_replica": routed,
    }


def token_range(text: str) -> tuple[int, int]:
    """``LOW,HIGH`` as a pair of ints."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two integers), got {text!r}") from None
    return low, high


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_lora", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults, trace_defaults = LoraReplayConfig(), LoraTraceConfig()
    parser.add_argument("--adapters", type=int, default=trace_defaults.num_adapters, help="LoRA adapters in the trace")
    parser.add_argument("--zipf", type=float, default=trace_defaults.zipf_s, help="Zipf exponent of their popularity")
    parser.add_argument("--requests", type=int, default=trace_defaults.num_requests)
    parser.add_argument("--rate", type=float, default=trace_defaults.rate_per_s, help="Poisson arrivals per second")
    parser.add_argument("--system-prompt-tokens", type=int, default=trace_defaults.system_prompt_tokens,
                        help="each adapter's shared prompt head")
    parser.add_argument("--tail-tokens", type=token_range, default=trace_defaults.tail_tokens,
                        help="LOW,HIGH: each request's own prompt tokens, uniform")
    parser.add_argument("--output-tokens", type=token_range, default=trace_defaults.output_tokens,
                        help="LOW,HIGH: each request's output tokens, uniform")
    parser.add_argument("--seed", type=int, default=0, help="seed of the trace, the engines and the policies")
    parser.add_argument("--replicas", type=int, default=defaults.num_replicas)
    parser.add_argument("--max-loras", type=int, default=defaults.max_loras, help="adapter slots per replica")
    parser.add_argument("--lora-rank", type=int, default=defaults.lora_rank, help="the adapters' rank (their size)")
    parser.add_argument("--kv-tokens", type=int, default=defaults.kv_tokens, help="KV per replica, in tokens")
    parser.add_argument("--model", default=defaults.model, help=f"a preset ({', '.join(MODELS)}) or a model directory")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default=defaults.hardware)
    parser.add_argument("--report-interval", type=float, default=defaults.report_interval_s,
                        help="seconds between the replicas' routing-stats reports")
    parser.add_argument("--policies", default="affinity,latency",
                        help="comma-separated subset of " + ",".join(POLICIES))
    args = parser.parse_args(argv)

    trace = LoraTraceConfig(num_adapters=args.adapters, zipf_s=args.zipf, num_requests=args.requests,
                            rate_per_s=args.rate, system_prompt_tokens=args.system_prompt_tokens,
                            tail_tokens=args.tail_tokens, output_tokens=args.output_tokens, seed=args.seed)
    config = LoraReplayConfig(num_replicas=args.replicas, max_loras=args.max_loras, lora_rank=args.lora_rank,
                              kv_tokens=args.kv_tokens, model=args.model, hardware=args.hardware,
                              report_interval_s=args.report_interval, seed=args.seed)
    context = {"adapters": args.adapters, "zipf": args.zipf, "replicas": args.replicas, "max_loras": args.max_loras,
               "requests": args.requests, "rate": args.rate}
    for policy in args.policies.split(","):
        for routing in ROUTINGS:
            print(json.dumps({**replay(policy.strip(), routing, trace, config), **context}), flush=True)


if __name__ == "__main__":
    main()
