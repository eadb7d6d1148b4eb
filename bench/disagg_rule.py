"""Conditional disaggregation: goodput under SLOs with each remote-prefill rule, in the simulator.

``python -m bench.disagg_rule [--workloads short-long,long-short,mixed] [--split 4] [--unit-gpus 8]
[--seconds 30] [--stall-weights 1]``

One unit of ``--unit-gpus`` H200s serving Llama-3-8B (the analytic profile,
``sim.hardware``), ``--split`` of them prefilling, under each rule:

- ``threshold``: today's default, remote when more than 256 uncached tokens;
- ``always``: every prompt with an uncached token is prefilled remotely;
- ``predicted``: ``router.remote_prefill``'s predicted rule (with the
  predicted-latency prefill router), once per ``--stall-weights`` value.

For each, ``sim.plan.max_goodput`` finds the highest arrival rate at which
90% of requests meet both SLOs (TTFT ``--slo-ttft-ms``, mean ITL
``--slo-itl-ms`` and no gap over the TTFT target). Prints one JSON line per
(workload, rule), then one per workload with the predicted rule's goodput
over the better of the two fixed rules (goal ≥ 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from autoscale.planner import Slo
from pd.config import EngineConfig
from pd.model.config import load_model_config
from router.remote_prefill import RemotePrefillRule
from sim.cost import CostModel
from sim.hardware import HARDWARE, Efficiency, analytic_cost, kv_cache_bytes, link, model_dir
from sim.plan import SEQS_PER_GPU, Layout, max_goodput, synthetic, unit_spec

RULES = {
    "threshold": RemotePrefillRule(),
    "always": RemotePrefillRule(threshold=0, queue_bound=1 << 30),
}


def rules(stall_weights: list[float]) -> dict[str, RemotePrefillRule]:
    predicted = {f"predicted(stall_weight={weight:g})": RemotePrefillRule(predicted=True, stall_weight=weight)
                 for weight in stall_weights}
    return {**RULES, **predicted}


def goodput(rule: RemotePrefillRule, workload: str, args: argparse.Namespace, engine: EngineConfig,
            cost: CostModel) -> dict:
    layout = Layout(args.split, args.unit_gpus - args.split, rule.threshold, engine.max_num_batched_tokens)
    spec = dataclasses.replace(unit_spec(layout, engine, cost, link(HARDWARE[args.hardware], "rdma")), rule=rule)
    trace = synthetic(workload, args.requests, args.seed)
    rate, attained = max_goodput(spec, trace, Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000), args.seconds,
                                 steps=args.bisection_steps)
    return {"rate_per_unit": round(rate, 3), "attainment": round(attained, 3),
            "goodput_per_gpu": round(rate * attained / args.unit_gpus, 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.disagg_rule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="short-long,long-short,mixed")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    parser.add_argument("--unit-gpus", type=int, default=8)
    parser.add_argument("--split", type=int, default=4, help="prefill GPUs of the unit")
    parser.add_argument("--stall-weights", default="1", help="the predicted rule's stall_weight values, comma-separated")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-itl-ms", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="simulated seconds per trial")
    parser.add_argument("--bisection-steps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.split < args.unit_gpus:
        parser.error(f"--split must leave both pools a GPU: 1..{args.unit_gpus - 1}")
    path = model_dir(args.model)
    config, gpu = load_model_config(path), HARDWARE[args.hardware]
    cost = analytic_cost(config, gpu, Efficiency())
    engine = EngineConfig(model=path, dtype="bfloat16", block_size=args.block_size,
                          kv_cache_bytes=kv_cache_bytes(config, gpu, Efficiency()), max_num_seqs=SEQS_PER_GPU,
                          max_num_batched_tokens=8192)
    candidates = rules([float(value) for value in args.stall_weights.split(",")])
    for workload in args.workloads.split(","):
        results = {}
        for name, rule in candidates.items():
            results[name] = goodput(rule, workload, args, engine, cost)
            print(json.dumps({"workload": workload, "rule": name, "split": f"{args.split}:{args.unit_gpus - args.split}",
                              **results[name]}), flush=True)
        fixed = max(results["threshold"]["goodput_per_gpu"], results["always"]["goodput_per_gpu"])
        print(json.dumps({"workload": workload, "predicted_over_best_fixed": {
            name: round(result["goodput_per_gpu"] / fixed, 3) if fixed else None
            for name, result in results.items() if name.startswith("predicted")},
            "hardware": args.hardware, "model": args.model, "profile": cost.source}), flush=True)


if __name__ == "__main__":
    main()
