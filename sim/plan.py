"""Size the pools: which prefill:decode split (or colocated) gives the most goodput per GPU under SLOs.

``python -m sim.plan --model llama-3-8b --hardware h200 --gpus 1000 [--trace F | --workload mooncake]
--slo-ttft-ms 500 --slo-itl-ms 50``

The fleet is planned as ``gpus / unit_gpus`` copies of one unit of
``--unit-gpus`` GPUs, each unit serving its share of the traffic. For every
layout of a unit (colocated, and every ``p:d`` GPUs with ``p + d = unit``),
every expert-parallel size per pool (``--prefill-ep``, ``--decode-ep``: a
replica spans that many GPUs, so ``p / prefill_ep`` prefill replicas and
``d / decode_ep`` decode replicas), every remote-prefill threshold and chunk
size asked for, the simulator finds the highest arrival rate at which at
least 90% of requests meet both SLOs (TTFT, and mean inter-token latency
with no stall longer than the TTFT target: see ``attainment``). Goodput per
GPU is that rate times the attainment over the unit's GPUs. Prints one JSON
object per candidate, then the best with a ``serve_configs``-style YAML for
the whole fleet (checked by ``AppArgs``).

An expert-parallel size whose rank cannot hold its share of the weights is
left out, with a line saying why, and so are the layouts that need it
(DeepSeek-V3's 673 GB of FP8 weights fit H200s only at EP 8, so a node of
eight holds one replica and cannot be split). Profiles are analytic
(``sim.hardware``) unless ``--profile`` gives a measured one (for one-GPU
replicas only). An expert-parallel pool's replica is one
simulated engine priced on its busiest rank (``sim.engine``); the YAML's
``engine:`` section is shared, so its ``kv_cache_bytes`` is what a rank of
the layout's smallest expert-parallel size leaves, and ``max_num_seqs`` is
256 for every GPU of a decode replica.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from dataclasses import dataclass
from typing import Mapping

from autoscale.planner import Slo
from pd.config import EngineConfig
from pd.model.config import load_model_config
from pd.workload.trace import MultiTenantTraceConfig, TraceRequest, generate_multi_tenant, load_trace
from router.remote_prefill import RemotePrefillRule
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.cost import CostModel
from sim.expert_parallel import ExpertParallel
from sim.hardware import HARDWARE, MODELS, Efficiency, analytic_cost, kv_cache_bytes, link, model_dir
from sim.workload import submit_trace

ATTAINMENT = 0.9
SEQS_PER_GPU = 256  # a decode replica's max_num_seqs, per GPU it spans
WORKLOADS = ("long-short", "short-long", "mixed", "mooncake")


def synthetic(workload: str, num_requests: int, seed: int) -> list[TraceRequest]:
    """A trace at 1 request/s: long prompts with short outputs, the reverse, half of each (mixed), or the
    multi-tenant mix."""
    if workload == "mooncake":
        return generate_multi_tenant(MultiTenantTraceConfig(num_requests=num_requests, rate_per_s=1.0, seed=seed))
    rng = random.Random(seed)
    shapes = {"long-short": ((6144, 10240), (32, 160)), "short-long": ((128, 512), (512, 1536))}
    requests, now_ms = [], 0.0
    for index in range(num_requests):
        now_ms += rng.expovariate(1.0) * 1000
        kind = workload if workload != "mixed" else rng.choice(sorted(shapes))
        prompt, output = shapes[kind]
        length = rng.randint(*prompt)
        first = 10_000_000 * (index + 1)  # no two requests share a block
        requests.append(TraceRequest(timestamp_ms=now_ms, input_length=length, output_length=rng.randint(*output),
                                     hash_ids=tuple(range(first, first + -(-length // 512)))))
    return requests


@dataclass(frozen=True)
class Layout:
    """A unit's pools: replicas of each (``prefill_ep`` and ``decode_ep`` GPUs a replica), and the engine's knobs."""

    num_prefill: int
    num_decode: int
    threshold: int
    max_num_batched_tokens: int
    threshold_per_in_flight: float = 0.0
    prefill_ep: int = 1
    decode_ep: int = 1

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill_ep + self.num_decode * self.decode_ep

    @property
    def expert_parallel_sizes(self) -> tuple[int, ...]:
        """The EP sizes of the pools the layout has."""
        return (self.prefill_ep, self.decode_ep) if self.num_prefill else (self.decode_ep,)

    @property
    def name(self) -> str:
        """GPUs per pool: ``6:2``, ``colocated:8``; with ``EP p:d`` (or ``EP d``) where a pool is expert-parallel."""
        decode_gpus = self.num_decode * self.decode_ep
        split = f"{self.num_prefill * self.prefill_ep}:{decode_gpus}" if self.num_prefill else f"colocated:{decode_gpus}"
        if self.expert_parallel_sizes == (1,) * len(self.expert_parallel_sizes):
            return split
        return f"{split} EP {':'.join(map(str, self.expert_parallel_sizes))}"


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
    gpus = sum(pool.num_replicas * pool.engine.num_ranks for pool in (spec.decode, spec.prefill) if pool is not None)
    rate, failures = 0.25 * gpus, 0
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


def pool_engine(engine: EngineConfig, expert_parallel_size: int) -> EngineConfig:
    """A pool's engine: over ``expert_parallel_size`` ranks, attention split over the same ranks."""
    if expert_parallel_size == 1:
        return engine
    return dataclasses.replace(engine, tensor_parallel_size=expert_parallel_size,
                               expert_parallel_size=expert_parallel_size)


def unit_spec(layout: Layout, engine: EngineConfig, cost: CostModel, transfer,
              ep_costs: Mapping[int, CostModel] | None = None) -> ClusterSpec:
    """One unit of ``layout``: ``cost`` is a one-GPU replica's step, ``ep_costs`` an expert-parallel one's by size."""
    costs = {1: cost, **(ep_costs or {})}
    missing = sorted(set(layout.expert_parallel_sizes) - set(costs))
    if missing:
        raise ValueError(f"layout {layout.name} needs the step cost of expert parallelism {missing[0]}: pass ep_costs")
    engine = dataclasses.replace(engine, max_num_batched_tokens=layout.max_num_batched_tokens)

    def pool(num_replicas: int, ep: int) -> PoolSpec:
        return PoolSpec(num_replicas, pool_engine(engine, ep), costs[ep])

    return ClusterSpec(decode=pool(layout.num_decode, layout.decode_ep),
                       prefill=pool(layout.num_prefill, layout.prefill_ep) if layout.num_prefill else None,
                       rule=RemotePrefillRule(threshold=layout.threshold,
                                              threshold_per_in_flight=layout.threshold_per_in_flight),
                       transfer=transfer, call_s=0.001)


def fleet_yaml(layout: Layout, model: str, engine: EngineConfig, units: int, num_redundant_experts: int = 0) -> dict:
    """The ``serve run`` config of the whole fleet, its args checked by ``AppArgs``.

    Each pool names its replicas' ranks (``tensor_parallel_size`` and
    ``expert_parallel_size``, equal: attention split over the expert-parallel
    ranks) and its expert-parallel pools their ``num_redundant_experts``;
    ``ray_actor_options`` are one rank's.

    ``engine.model`` is what ``--model`` named: for a preset, point it at the checkpoint's directory.
    A unit was simulated with one ingress; in the fleet each ingress replica
    takes ``units / ingresses`` units' traffic and counts only its own
    prefill calls in flight, so the rule's load terms are scaled to keep its
    decisions at the same load per prefill replica.
    """
    from pd.config.app import AppArgs

    gpu_pool = {"ray_actor_options": {"num_gpus": 1, "num_cpus": 4}, "max_ongoing_requests": 256}

    def ranks(ep: int) -> dict:
        redundant = {"num_redundant_experts": num_redundant_experts} if ep > 1 and num_redundant_experts else {}
        return {"tensor_parallel_size": ep, "expert_parallel_size": ep, **redundant}

    ingresses = max(1, units // 4)
    args = {
        "mode": "disaggregated" if layout.num_prefill else "colocated",
        "engine": {"model": model, "dtype": "bfloat16", "device": "cuda", "block_size": engine.block_size,
                   "kv_cache_bytes": engine.kv_cache_bytes, "max_num_batched_tokens": layout.max_num_batched_tokens,
                   "max_num_seqs": engine.max_num_seqs},
        "decode": {"num_replicas": layout.num_decode * units, **gpu_pool, **ranks(layout.decode_ep)},
        "ingress": {"num_replicas": ingresses},
    }
    if layout.num_prefill:
        units_per_ingress = units / ingresses
        args["prefill"] = {"num_replicas": layout.num_prefill * units, **gpu_pool, **ranks(layout.prefill_ep)}
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
    parser.add_argument("--splits", help="prefill GPUs per unit to try, comma-separated (default: all, "
                        "0 meaning colocated)")
    parser.add_argument("--prefill-ep", default="1", help="expert-parallel sizes of a prefill replica to try "
                        "(GPUs it spans, attention split over them), comma-separated")
    parser.add_argument("--decode-ep", default="1", help="expert-parallel sizes of a decode (or colocated) replica "
                        "to try, comma-separated")
    parser.add_argument("--redundant-experts", type=int, default=0,
                        help="num_redundant_experts of an expert-parallel replica (memory on every rank)")
    parser.add_argument("--balancedness", type=float, default=1.0,
                        help="an expert-parallel replica's mean over max tokens per rank (1.0: balanced, as "
                        "uniform routing is); its busiest rank's expert work is the mean's over it")
    parser.add_argument("--profile", help="a measured CostModel JSON instead of the analytic one")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="simulated seconds of traffic per trial (the first third is warm-up)")
    parser.add_argument("--bisection-steps", type=int, default=3,
                        help="bisections of the highest passing rate (each halves the gap to the first failing one)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _layouts(args: argparse.Namespace, prefill_eps: list[int], decode_eps: list[int]) -> list[Layout]:
    """The layouts to try, chunk size outermost, then the pools' EP sizes; a split only where each EP size
    divides its pool's GPUs. Colocated ones only with the first threshold, slope and prefill EP size
    (colocated has no remote-prefill rule nor prefill pool, so the others would repeat it)."""
    splits = _ints(args.splits) if args.splits else range(args.unit_gpus)
    thresholds = _ints(args.thresholds)
    slopes = [float(value) for value in args.slopes.split(",") if value.strip()]
    layouts = []
    for chunk in _ints(args.chunks):
        for prefill_ep in prefill_eps:
            for decode_ep in decode_eps:
                for p in splits:
                    d = args.unit_gpus - p
                    if d < 1 or p % prefill_ep or d % decode_ep or (not p and prefill_ep != prefill_eps[0]):
                        continue
                    layouts += [Layout(p // prefill_ep, d // decode_ep, t, chunk, slope,
                                       prefill_ep if p else 1, decode_ep)
                                for t in thresholds for slope in slopes
                                if p or (t, slope) == (thresholds[0], slopes[0])]
    return layouts


def _parallel(args: argparse.Namespace, ep: int) -> ExpertParallel:
    return ExpertParallel(ep, args.redundant_experts, args.balancedness) if ep > 1 else ExpertParallel()


def layout_engine(layout: Layout, engine: EngineConfig, kv_bytes_by_ep: Mapping[int, int]) -> EngineConfig:
    """The engine section a layout shares: the KV a rank of its smallest EP size leaves (every rank of a
    larger one holds fewer weights), and ``SEQS_PER_GPU`` sequences a GPU of a decode replica."""
    return dataclasses.replace(engine, kv_cache_bytes=min(kv_bytes_by_ep[ep] for ep in layout.expert_parallel_sizes),
                               max_num_seqs=SEQS_PER_GPU * layout.decode_ep)


def main(argv: list[str] | None = None) -> None:
    import yaml

    parser = _parser()
    args = parser.parse_args(argv)
    if args.gpus % args.unit_gpus:
        parser.error(f"--gpus {args.gpus} is not a multiple of --unit-gpus {args.unit_gpus}")

    path = model_dir(args.model)
    config, gpu, efficiency = load_model_config(path), HARDWARE[args.hardware], Efficiency()
    cost = CostModel.load(args.profile) if args.profile else analytic_cost(config, gpu, efficiency)
    sizes = sorted(set(_ints(args.prefill_ep)) | set(_ints(args.decode_ep)))
    try:
        for ep in sizes:
            _parallel(args, ep).check(config)
    except ValueError as exc:  # a size the experts or heads do not divide
        parser.error(str(exc))
    kv_bytes_by_ep, refused = {}, {}
    for ep in sizes:  # a size whose rank cannot hold its weights is left out, and said so
        try:
            kv_bytes_by_ep[ep] = kv_cache_bytes(config, gpu, efficiency, _parallel(args, ep))
        except ValueError as exc:
            refused[ep] = str(exc)
            print(json.dumps({"expert_parallel_size": ep, "refused": str(exc)}), flush=True)
    ep_costs = {ep: analytic_cost(config, gpu, efficiency, _parallel(args, ep)) for ep in kv_bytes_by_ep if ep > 1}
    if ep_costs and args.profile:
        parser.error("--profile is a one-GPU replica's step: expert-parallel sizes above 1 are priced analytically")
    prefill_eps = [ep for ep in _ints(args.prefill_ep) if ep in kv_bytes_by_ep]
    decode_eps = [ep for ep in _ints(args.decode_ep) if ep in kv_bytes_by_ep]
    layouts = _layouts(args, prefill_eps, decode_eps) if prefill_eps and decode_eps else []
    if not layouts:
        why = "; ".join(refused.values()) or "the --prefill-ep and --decode-ep sizes divide none of its pools"
        parser.error(f"no split of --unit-gpus {args.unit_gpus} has pools that fit: {why}")
    engine = EngineConfig(model=path, dtype="bfloat16", block_size=args.block_size,
                          kv_cache_bytes=kv_bytes_by_ep[min(kv_bytes_by_ep)], max_num_seqs=SEQS_PER_GPU)
    trace = workload_trace(args.trace, args.workload, args.seed)
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    units = args.gpus // args.unit_gpus
    results = []
    for layout in layouts:
        spec = unit_spec(layout, layout_engine(layout, engine, kv_bytes_by_ep), cost, link(gpu, "rdma"), ep_costs)
        rate, attained = max_goodput(spec, trace, slo, args.seconds, steps=args.bisection_steps)
        result = {"layout": layout.name, "prefill_ep": layout.prefill_ep if layout.num_prefill else None,
                  "decode_ep": layout.decode_ep, "remote_prefill_threshold": layout.threshold,
                  "threshold_per_in_flight": layout.threshold_per_in_flight,
                  "max_num_batched_tokens": layout.max_num_batched_tokens, "rate_per_unit": round(rate, 3),
                  "attainment": round(attained, 3), "goodput_per_gpu": round(rate * attained / args.unit_gpus, 4)}
        results.append((layout, result))
        print(json.dumps(result), flush=True)
    best_layout, best = max(results, key=lambda item: item[1]["goodput_per_gpu"])
    colocated = max((r["goodput_per_gpu"] for layout, r in results if not layout.num_prefill), default=0.0)
    print(json.dumps({"best": best, "gain_over_colocated": round(best["goodput_per_gpu"] / colocated, 3)
                      if colocated else None, "gpus": args.gpus, "hardware": args.hardware, "model": args.model,
                      "workload": args.trace or args.workload,
                      "profile": {1: cost, **ep_costs}[best_layout.decode_ep].source,
                      "refused_expert_parallel_sizes": sorted(refused)}), flush=True)
    print(yaml.safe_dump(fleet_yaml(best_layout, args.model, layout_engine(best_layout, engine, kv_bytes_by_ep), units,
                                    args.redundant_experts), sort_keys=False))



if __name__ == "__main__":
    main()
