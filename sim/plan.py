"""Size the pools: which prefill:decode split (or colocated) gives the most goodput per GPU under SLOs.

``python -m sim.plan --model llama-3-8b --hardware h200 --gpus 1000 [--trace F | --workload mooncake]
--slo-ttft-ms 500 --slo-itl-ms 50``

The fleet is planned as ``gpus / unit_gpus`` copies of one unit of
``--unit-gpus`` replicas (one GPU each), each unit serving its share of the
traffic. For every layout of a unit (colocated, and every ``p:d`` with
``p + d = unit``), every remote-prefill threshold and chunk size asked for,
the simulator finds the highest arrival rate at which at least 90% of
requests meet both SLOs (TTFT, and mean inter-token latency with no
stall longer than the TTFT target: see ``attainment``). Goodput per
GPU is that rate times the attainment over the unit's GPUs. Prints one JSON
object per candidate, then the best with a ``serve_configs``-style YAML for
the whole fleet (checked by ``AppArgs``).

Profiles are analytic (``sim.hardware``) unless ``--profile`` gives a measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from dataclasses import dataclass

from autoscale.planner import Slo
from pd.config import EngineConfig
from pd.model.config import load_model_config
from pd.workload.trace import MultiTenantTraceConfig, TraceRequest, generate_multi_tenant, load_trace
from router.remote_prefill import RemotePrefillRule
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.cost import CostModel
from sim.hardware import HARDWARE, MODELS, Efficiency, analytic_cost, kv_cache_bytes, link, model_dir
from sim.workload import submit_trace

ATTAINMENT = 0.9
WORKLOADS = ("long-short", "short-long", "mooncake")


def synthetic(workload: str, num_requests: int, seed: int) -> list[TraceRequest]:
    """A trace at 1 request/s: long prompts with short outputs, the reverse, or the multi-tenant mix."""
    if workload == "mooncake":
        return generate_multi_tenant(MultiTenantTraceConfig(num_requests=num_requests, rate_per_s=1.0, seed=seed))
    rng = random.Random(seed)
    prompt, output = ((6144, 10240), (32, 160)) if workload == "long-short" else ((128, 512), (512, 1536))
    requests, now_ms = [], 0.0
    for index in range(num_requests):
        now_ms += rng.expovariate(1.0) * 1000
        length = rng.randint(*prompt)
        first = 10_000_000 * (index + 1)  # no two requests share a block
        requests.append(TraceRequest(timestamp_ms=now_ms, input_length=length, output_length=rng.randint(*output),
                                     hash_ids=tuple(range(first, first + -(-length // 512)))))
    return requests


@dataclass(frozen=True)
class Layout:
    num_prefill: int
    num_decode: int
    threshold: int
    max_num_batched_tokens: int
    threshold_per_in_flight: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.num_prefill}:{self.num_decode}" if self.num_prefill else f"colocated:{self.num_decode}"


def attainment(cluster: SimCluster, slo: Slo, after_s: float = 0.0) -> float:
    """The fraction of requests arriving after ``after_s`` that met both SLOs (caches warm by then).

    A request meets them with its first token within the TTFT target, a mean
    inter-token time within the ITL target, and no wait between two tokens
    longer than the TTFT target. Without the last, an overloaded decode pool
    passed: a remote prefill's first token came at once, and the request then
    queued on its decode replica for seconds, which a mean over a thousand
    tokens hides (short-long at 1:3, threshold 0: 0.90 of requests "met" both
    at twice the decode pool's capacity, with a median 17 s between their
    first and second tokens).
    """
    met = counted = 0
    for record in cluster.records.values():
        if record.arrival_s < after_s:
            continue
        counted += 1
        if record.finished_s is None or not record.token_times_s:
            continue
        gaps = record.itls_s()
        if record.ttft_s <= slo.ttft_s and (not gaps or (sum(gaps) / len(gaps) <= slo.itl_s
                                                         and max(gaps) <= slo.ttft_s)):
            met += 1
    return met / counted if counted else 0.0


def run(spec: ClusterSpec, trace: list[TraceRequest], rate: float, seconds: float) -> SimCluster:
    """Serve the trace's first ``seconds`` at ``rate`` requests/s (its times rescaled from 1 request/s)."""
    cluster = SimCluster(EventLoop(), spec)
    submit_trace(cluster, trace, time_scale=rate, until_s=seconds)
    cluster.loop.run()
    return cluster


RATE_STEP = 1.6  # between the rates of the first scan


def max_goodput(spec: ClusterSpec, trace, slo: Slo, seconds: float, steps: int = 3) -> tuple[float, float]:
    """``(rate, attainment)``: the highest rate found at which ``ATTAINMENT`` of requests meet the SLOs.

    Attainment need not fall monotonically with the rate (a prefix-sharing
    trace warms its caches faster at a higher rate), so a geometric scan
    goes on until two rates in a row fail, and the highest passing one is
    refined by bisection towards the next. The first third of each run is
    warm-up and not counted.
    """
    def attained(rate: float) -> float:
        return attainment(run(spec, trace, rate, seconds), slo, after_s=seconds / 3)

    good, good_attained, bad = 0.0, 0.0, None
    rate, failures = 0.25 * spec.num_replicas, 0
    for _ in range(16):
        value = attained(rate)
        if value >= ATTAINMENT:
            good, good_attained, bad, failures = rate, value, None, 0
        else:
            bad = bad if bad is not None else rate
            failures += 1
            if failures == 2:
                break
        rate *= RATE_STEP
    if bad is None or good == 0.0:
        return good, good_attained
    for _ in range(steps):
        rate = (good + bad) / 2
        value = attained(rate)
        if value >= ATTAINMENT:
            good, good_attained = rate, value
        else:
            bad = rate
    return good, good_attained


def unit_spec(layout: Layout, engine: EngineConfig, cost: CostModel, transfer) -> ClusterSpec:
    engine = dataclasses.replace(engine, max_num_batched_tokens=layout.max_num_batched_tokens)
    return ClusterSpec(decode=PoolSpec(layout.num_decode, engine, cost),
                       prefill=PoolSpec(layout.num_prefill, engine, cost) if layout.num_prefill else None,
                       rule=RemotePrefillRule(threshold=layout.threshold,
                                              threshold_per_in_flight=layout.threshold_per_in_flight),
                       transfer=transfer, call_s=0.001)


def fleet_yaml(layout: Layout, model: str, engine: EngineConfig, units: int) -> dict:
    """The ``serve run`` config of the whole fleet, its args checked by ``AppArgs``.

    ``engine.model`` is what ``--model`` named: for a preset, point it at the checkpoint's directory.
    A unit was simulated with one ingress; in the fleet each ingress replica
    takes ``units / ingresses`` units' traffic and counts only its own
    prefill calls in flight, so the rule's load terms are scaled to keep its
    decisions at the same load per prefill replica.
    """
    from pd.config.app import AppArgs

    gpu_pool = {"ray_actor_options": {"num_gpus": 1, "num_cpus": 4}, "max_ongoing_requests": 256}
    ingresses = max(1, units // 4)
    args = {
        "mode": "disaggregated" if layout.num_prefill else "colocated",
        "engine": {"model": model, "dtype": "bfloat16", "device": "cuda", "block_size": engine.block_size,
                   "kv_cache_bytes": engine.kv_cache_bytes, "max_num_batched_tokens": layout.max_num_batched_tokens},
        "decode": {"num_replicas": layout.num_decode * units, **gpu_pool},
        "ingress": {"num_replicas": ingresses},
    }
    if layout.num_prefill:
        units_per_ingress = units / ingresses
        args["prefill"] = {"num_replicas": layout.num_prefill * units, **gpu_pool}
        args["remote_prefill_threshold"] = layout.threshold
        args["remote_prefill_threshold_per_in_flight"] = layout.threshold_per_in_flight / units_per_ingress
        args["prefill_queue_bound"] = math.ceil(RemotePrefillRule().queue_bound * units_per_ingress)
    AppArgs.parse(args)
    return {"applications": [{"name": "pd", "route_prefix": "/", "import_path": "pd.serve.app:build_app",
                              "args": args}]}


def workload_trace(path: str | None, workload: str, seed: int) -> list[TraceRequest]:
    """The trace a plan serves, at 1 request/s (a file's arrival times rescaled to it)."""
    if not path:
        return synthetic(workload, 20_000, seed)
    trace = load_trace(path)
    mean_rate = len(trace) / max(1e-9, (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000)
    return [dataclasses.replace(r, timestamp_ms=(r.timestamp_ms - trace[0].timestamp_ms) * mean_rate) for r in trace]


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", help=f"a preset ({', '.join(MODELS)}) or a model directory")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--unit-gpus", type=int, default=8)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", help="a Mooncake-format trace (its arrival times are rescaled)")
    source.add_argument("--workload", choices=WORKLOADS, default="mooncake")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-itl-ms", type=float, default=50.0)
    parser.add_argument("--thresholds", default="256", help="remote-prefill thresholds to try, comma-separated")
    parser.add_argument("--slopes", default="0", help="remote_prefill_threshold_per_in_flight values to try "
                        "(tokens added to the threshold per prefill call in flight), comma-separated")
    parser.add_argument("--chunks", default="8192", help="max_num_batched_tokens values to try, comma-separated")
    parser.add_argument("--splits", help="prefill replicas per unit to try, comma-separated (default: all, "
                        "0 meaning colocated)")
    parser.add_argument("--profile", help="a measured CostModel JSON instead of the analytic one")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="simulated seconds of traffic per trial (the first third is warm-up)")
    parser.add_argument("--bisection-steps", type=int, default=3,
                        help="bisections of the highest passing rate (each halves the gap to the first failing one)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _layouts(args: argparse.Namespace) -> list[Layout]:
    """The layouts to try, chunk size outermost; colocated ones only with the first threshold and slope
    (colocated has no remote-prefill rule, so the others would repeat it)."""
    splits = _ints(args.splits) if args.splits else range(args.unit_gpus)
    thresholds = _ints(args.thresholds)
    slopes = [float(value) for value in args.slopes.split(",") if value.strip()]
    layouts = [Layout(p, args.unit_gpus - p, t, c, slope) for c in _ints(args.chunks) for p in splits
               for t in thresholds for slope in slopes]
    return [layout for layout in layouts if layout.num_prefill
            or (layout.threshold, layout.threshold_per_in_flight) == (thresholds[0], slopes[0])]


def main(argv: list[str] | None = None) -> None:
    import yaml

    parser = _parser()
    args = parser.parse_args(argv)
    if args.gpus % args.unit_gpus:
        parser.error(f"--gpus {args.gpus} is not a multiple of --unit-gpus {args.unit_gpus}")

    path = model_dir(args.model)
    config, gpu = load_model_config(path), HARDWARE[args.hardware]
    cost = CostModel.load(args.profile) if args.profile else analytic_cost(config, gpu, Efficiency())
    engine = EngineConfig(model=path, dtype="bfloat16", block_size=args.block_size,
                          kv_cache_bytes=kv_cache_bytes(config, gpu), max_num_seqs=256)
    trace = workload_trace(args.trace, args.workload, args.seed)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    units = args.gpus // args.unit_gpus
    results = []
    for layout in _layouts(args):
        rate, attained = max_goodput(unit_spec(layout, engine, cost, link(gpu, "rdma")), trace, slo, args.seconds,
                                     steps=args.bisection_steps)
        result = {"layout": layout.name, "remote_prefill_threshold": layout.threshold,
                  "threshold_per_in_flight": layout.threshold_per_in_flight,
                  "max_num_batched_tokens": layout.max_num_batched_tokens, "rate_per_unit": round(rate, 3),
                  "attainment": round(attained, 3), "goodput_per_gpu": round(rate * attained / args.unit_gpus, 4)}
        results.append((layout, result))
        print(json.dumps(result), flush=True)
    best_layout, best = max(results, key=lambda item: item[1]["goodput_per_gpu"])
    colocated = max((r["goodput_per_gpu"] for layout, r in results if not layout.num_prefill), default=0.0)
    print(json.dumps({"best": best, "gain_over_colocated": round(best["goodput_per_gpu"] / colocated, 3)
                      if colocated else None, "gpus": args.gpus, "hardware": args.hardware, "model": args.model,
                      "workload": args.trace or args.workload, "profile": cost.source}), flush=True)
    print(yaml.safe_dump(fleet_yaml(best_layout, args.model, engine, units), sort_keys=False))



if __name__ == "__main__":
    main()
