"""How far the simulator reaches: a fleet of replicas under a Mooncake-like trace, and the wall time it takes.

``python -m sim.scale --replicas 1000 --minutes 10 [--hardware h200] [--model llama-3-8b]
[--prefill-fraction 0.25] [--utilization 0.7]``

The fleet runs the analytic profile of ``--model`` on ``--hardware``
(``sim.hardware``), disaggregated with ``--prefill-fraction`` of its
replicas prefilling (0: colocated). The load is ``pd.workload.trace``'s
multi-tenant generator (Zipf tenants with long shared contexts, multi-turn
conversations), at the rate that keeps the replicas about ``--utilization``
busy: a pilot of 16 replicas finds the rate, and the fleet gets it times
``replicas / 16``. Replicas fast-forward their runs of decode-only steps
(``sim.fast_forward``); ``--no-fast-forward`` steps each one, for the same
result, slower. Prints one JSON object: ``wall_s`` is the fleet's run, the
pilot's left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from pd.config import EngineConfig
from pd.model.config import load_model_config
from pd.workload.trace import MultiTenantTraceConfig, generate_multi_tenant
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.hardware import HARDWARE, MODELS, Efficiency, analytic_cost, kv_cache_bytes, link, model_dir
from sim.workload import submit_trace

PILOT_REPLICAS = 16
PILOT_S = 60.0


def fleet(model: str, hardware: str, replicas: int, prefill_fraction: float, block_size: int,
          max_num_batched_tokens: int) -> ClusterSpec:
    path = model_dir(model)
    config = load_model_config(path)
    gpu = HARDWARE[hardware]
    engine = EngineConfig(model=path, dtype="bfloat16", block_size=block_size,
                          kv_cache_bytes=kv_cache_bytes(config, gpu), max_num_batched_tokens=max_num_batched_tokens,
                          max_num_seqs=256)
    cost = analytic_cost(config, gpu, Efficiency())
    num_prefill = round(replicas * prefill_fraction)
    return ClusterSpec(decode=PoolSpec(replicas - num_prefill, engine, cost),
                       prefill=PoolSpec(num_prefill, engine, cost) if num_prefill else None,
                       transfer=link(gpu, "rdma"), call_s=0.001)


def serve_trace(spec: ClusterSpec, rate_per_s: float, duration_s: float, seed: int,
                fast_forward: bool = True) -> tuple[SimCluster, int, float, float]:
    """Serve ``duration_s`` of the trace; ``(cluster, requests, wall seconds, CPU seconds)``: on a shared
    machine the process's own CPU time says more than wall time. ``fast_forward`` False: every replica steps
    one step at a time (``sim.fast_forward``: the same result, slower)."""
    # Conversations go on after the window (later turns): generate more, keep the window's arrivals.
    trace = generate_multi_tenant(MultiTenantTraceConfig(num_requests=max(1, round(2 * rate_per_s * duration_s)),
                                                         rate_per_s=rate_per_s, seed=seed))
    trace = [request for request in trace if request.timestamp_ms <= duration_s * 1000]
    cluster = SimCluster(EventLoop(), spec)
    for pool in cluster.pools():
        for replica in pool.replicas.values():
            replica.fast_forward = fast_forward
    started, cpu_started = time.perf_counter(), time.process_time()
    submit_trace(cluster, trace)
    cluster.loop.run()
    return cluster, len(trace), time.perf_counter() - started, time.process_time() - cpu_started


def utilization(cluster: SimCluster) -> float:
    """Modelled compute time over replica time, from the first arrival to the last output."""
    busy, span_s = cluster.busy_s(), cluster.loop.now
    return sum(busy.values()) / (len(busy) * span_s) if busy and span_s > 0 else 0.0


def pilot_rate(spec: ClusterSpec, target: float, seed: int) -> float:
    """Requests/s per replica that keep a pilot fleet ``target`` busy (two corrections of a first guess)."""
    pilot = _resized(spec, PILOT_REPLICAS)
    rate = 1.0 * PILOT_REPLICAS
    for _ in range(3):
        cluster, *_ = serve_trace(pilot, rate, PILOT_S, seed)
        busy = utilization(cluster)
        rate *= min(4.0, target / max(busy, 1e-3))
    return rate / PILOT_REPLICAS


def _resized(spec: ClusterSpec, replicas: int) -> ClusterSpec:
    prefill_fraction = spec.prefill.num_replicas / spec.num_replicas if spec.prefill else 0.0
    num_prefill = round(replicas * prefill_fraction) if prefill_fraction else 0
    return dataclasses.replace(
        spec, decode=dataclasses.replace(spec.decode, num_replicas=replicas - num_prefill),
        prefill=dataclasses.replace(spec.prefill, num_replicas=num_prefill) if num_prefill else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    parser.add_argument("--model", default="llama-3-8b", help=f"a preset ({', '.join(MODELS)}) or a model directory")
    parser.add_argument("--prefill-fraction", type=float, default=0.25)
    parser.add_argument("--utilization", type=float, default=0.7)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fast-forward", action="store_true",
                        help="step every replica one step at a time (the same result; for timing the difference)")
    args = parser.parse_args(argv)
    spec = fleet(args.model, args.hardware, args.replicas, args.prefill_fraction, args.block_size,
                 args.max_num_batched_tokens)
    rate = pilot_rate(spec, args.utilization, args.seed) * args.replicas
    duration_s = args.minutes * 60
    cluster, requests, wall_s, cpu_s = serve_trace(spec, rate, duration_s, args.seed, not args.no_fast_forward)
    runners = [replica.engine.runner for pool in cluster.pools() for replica in pool.replicas.values()]
    steps = sum(runner.num_steps for runner in runners)
    print(json.dumps({
        "replicas": args.replicas, "simulated_s": round(cluster.loop.now, 1), "wall_s": round(wall_s, 1),
        "cpu_s": round(cpu_s, 1),
        "requests": requests, "requests_per_wall_s": round(requests / wall_s, 1),
        "replica_steps_per_wall_s": round(steps / wall_s, 1), "replica_steps": steps,
        "fast_forwarded_fraction": round(sum(r.num_fast_forwarded_steps for r in runners) / max(steps, 1), 3),
        "rate_per_s": round(rate, 1),
        "utilization": round(utilization(cluster), 3), "hardware": args.hardware, "model": args.model,
        "profile": spec.decode.cost.source,
    }))


if __name__ == "__main__":
    main()
