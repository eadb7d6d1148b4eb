"""Autoscaling policies compared in the simulator on a bursty trace.

``python -m bench.autoscale [--trace F] [--plot F.png]`` serves one trace on a
disaggregated deployment (the analytic profile of ``--model`` on
``--hardware``, ``sim.hardware``) three times, sized by:

- ``planner``: ``autoscale.planner`` (``sim.autoscale.PlannerAutoscaler``);
- ``static_peak``: a fixed fleet of the most replicas of each pool the planner
  used at any time: the fleet sized for the peak by the same capacity model;
- ``ray_default``: Ray Serve's default queue-length policy with its
  documented defaults (``sim.autoscale.RayDefaultAutoscaler``).

Every policy's pools stay within ``--max-replicas``, start from one replica
each, and new replicas serve ``--startup-s`` after they are asked for. Prints
one JSON row per policy: ``attainment`` (requests meeting both SLOs: TTFT, and
mean inter-token latency), ``replica_seconds`` (every replica from its start
to its stop or the last arrival, starting and draining included), their
ratio per replica-hour, and the most replicas of each pool. ``--plot`` draws
each policy's replicas over time against the offered load.

The default trace (``bench/traces/bursty.jsonl.gz``) is ``pd.workload.trace``'s
``generate_bursty`` with its defaults: 10 minutes of chat, a diurnal ramp to
2x and a 3x load step; ``--generate F`` writes it again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections import Counter
from pathlib import Path

from autoscale.planner import Bounds, PlannerConfig, Slo
from pd.config import EngineConfig
from pd.model.config import load_model_config
from pd.workload.trace import BurstyTraceConfig, TraceRequest, dump_trace, generate_bursty, load_trace
from sim.autoscale import PlannerAutoscaler, RayDefaultAutoscaler, StaticAutoscaler, Timeline, capacity, run
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.hardware import HARDWARE, MODELS, Efficiency, analytic_cost, kv_cache_bytes, link, model_dir
from sim.plan import attainment
from sim.workload import submit_trace

DEFAULT_TRACE = Path(__file__).parent / "traces" / "bursty.jsonl.gz"
POLICIES = ("planner", "static_peak", "ray_default")


def deployment(model: str, hardware: str, block_size: int = 64, max_num_batched_tokens: int = 8192) -> ClusterSpec:
    """One prefill and one decode replica to start from, each on one GPU."""
    path = model_dir(model)
    config, gpu = load_model_config(path), HARDWARE[hardware]
    engine = EngineConfig(model=path, dtype="bfloat16", block_size=block_size, kv_cache_bytes=kv_cache_bytes(config, gpu),
                          max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=256)
    cost = analytic_cost(config, gpu, Efficiency())
    return ClusterSpec(decode=PoolSpec(1, engine, cost), prefill=PoolSpec(1, engine, cost),
                       transfer=link(gpu, "rdma"), call_s=0.001)


def serve(spec: ClusterSpec, trace: list[TraceRequest], autoscaler, startup_s: float,
          slo: Slo) -> tuple[SimCluster, Timeline, dict]:
    cluster = SimCluster(EventLoop(), spec)
    submit_trace(cluster, trace)
    until_s = trace[-1].timestamp_ms / 1000
    timeline = run(cluster, autoscaler, until_s, startup_s)
    replica_seconds = sum(pool.replica_seconds(until_s) for pool in cluster.pools())
    attained = attainment(cluster, slo)
    return cluster, timeline, {
        "attainment": round(attained, 4), "replica_seconds": round(replica_seconds, 1),
        "attainment_per_replica_hour": round(attained / (replica_seconds / 3600), 4),
        "max_prefill": max(timeline.num_prefill, default=1), "max_decode": max(timeline.num_decode, default=1),
    }


def _shown(path: str) -> str:
    """A path as a reader finds it: relative to the working directory when it is under it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def write_plot(trace: list[TraceRequest], timelines: dict[str, Timeline], path: Path, bin_s: float = 10.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (load_axis, prefill_axis, decode_axis) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    counts = Counter(int(request.timestamp_ms / 1000 // bin_s) for request in trace)
    bins = sorted(counts)
    load_axis.plot([b * bin_s for b in bins], [counts[b] / bin_s for b in bins], color="black")
    load_axis.set_ylabel("arrivals / s")
    for name, timeline in timelines.items():
        prefill_axis.step(timeline.times_s, timeline.num_prefill, where="post", label=name)
        decode_axis.step(timeline.times_s, timeline.num_decode, where="post", label=name)
    prefill_axis.set_ylabel("prefill replicas")
    decode_axis.set_ylabel("decode replicas")
    decode_axis.set_xlabel("simulated seconds")
    prefill_axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="a Mooncake-format trace (.jsonl or .jsonl.gz)")
    parser.add_argument("--generate", help="write the default bursty trace to this file and exit")
    parser.add_argument("--model", default="llama-3-8b", help=f"a preset ({', '.join(MODELS)}) or a model directory")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-itl-ms", type=float, default=50.0)
    parser.add_argument("--max-replicas", type=int, default=8, help="per pool, for every policy")
    parser.add_argument("--startup-s", type=float, default=20.0, help="from a scale-up to the new replica serving")
    parser.add_argument("--period-s", type=float, default=5.0, help="the planner's metrics period")
    parser.add_argument("--scale-down-delay-s", type=float, default=60.0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--plot", help="write the replicas-over-time plot here (PNG)")
    args = parser.parse_args(argv)
    if args.generate:
        dump_trace(generate_bursty(BurstyTraceConfig()), args.generate)
        return
    logging.getLogger("pd").setLevel(logging.WARNING)

    trace = load_trace(args.trace)
    spec = deployment(args.model, args.hardware)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    bounds = Bounds(1, args.max_replicas)
    config = PlannerConfig(slo=slo, capacity=capacity(spec.decode.cost, spec.decode.engine.max_num_batched_tokens,
                                                      context_tokens=2048),
                           prefill=bounds, decode=bounds, period_s=args.period_s,
                           scale_down_delay_s=args.scale_down_delay_s)
    timelines: dict[str, Timeline] = {}
    peak = (args.max_replicas, args.max_replicas)
    for policy in args.policies.split(","):
        if policy == "planner":
            autoscaler = PlannerAutoscaler(config)
        elif policy == "static_peak":
            autoscaler = StaticAutoscaler(*peak, period_s=args.period_s)
        elif policy == "ray_default":
            autoscaler = RayDefaultAutoscaler((1, args.max_replicas), (1, args.max_replicas))
        else:
            parser.error(f"unknown policy {policy!r}; expected some of {', '.join(POLICIES)}")
        fleet = spec
        if policy == "static_peak":  # there from the start
            fleet = dataclasses.replace(spec, prefill=dataclasses.replace(spec.prefill, num_replicas=peak[0]),
                                        decode=dataclasses.replace(spec.decode, num_replicas=peak[1]))
        _, timeline, row = serve(fleet, trace, autoscaler, args.startup_s, slo)
        if policy == "planner":
            peak = (row["max_prefill"], row["max_decode"])
        timelines[policy] = timeline
        print(json.dumps({"policy": policy, **row, "requests": len(trace), "trace": _shown(args.trace),
                          "hardware": args.hardware, "model": args.model}), flush=True)
    if args.plot:
        write_plot(trace, timelines, Path(args.plot))


if __name__ == "__main__":
    main()
