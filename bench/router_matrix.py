"""The prefill routers over a matrix of traces, loads and seeds, in the cluster simulator, with medians and spreads.

``python -m bench.router_matrix [--traces system_prompt,multi_tenant,...] [--loads 0.5,0.75,0.9] [--seeds 6]
[--policies affinity,round_robin,ray_prefix,latency] [--candidate latency] [--replicas 8] [--cache-blocks 256]``

For every trace, a pilot serves its seed-0 draw with ``PILOT_POLICY``
(the prefix-affinity router) at the trace's default time scale
(``TRACE_DEFAULTS``) and reads the pool's utilization; each load in
``--loads`` is then that time scale times load over utilization (the load
is a fraction of what the pool can compute under that router). For
every load and every seed ``s`` (0 to ``--seeds`` - 1) it generates the
trace with seed ``s`` (``bench.router.build_trace``) and serves it with
every policy (``bench.router.replay``: the same simulated pool, its engines
and the random policies seeded ``s`` too). One seed is one draw of the
traffic; the spread over seeds says how much a difference between policies
is the draw's.

It prints JSON lines:

- ``machine``: the CPU and its vector ISA, since decision times are wall time
  here (on a loaded machine a decision's p99 is the odd one the OS preempted;
  its p50 is the decision's own cost);
- one per (trace, load, policy): ``median``, ``min`` and ``max`` over seeds of
  ``ttft_p99_s``, ``ttft_p50_s``, ``hit_rate``, ``max_min_load_ratio`` (null:
  some replica got no request), ``decide_us_p50`` and ``decide_us_p99``, as
  ``bench.router`` defines them, ``utilization``, and the trace's
  ``working_set_over_pool`` (distinct blocks of the trace over the blocks the
  pool's caches hold: above 1, caches must evict) and ``cacheable_hit_rate``
  (the hit rate of one unbounded cache: prompt tokens in full blocks an
  earlier request sent);
- one per (trace, load) with the goals of ``--candidate`` against the best of
  the *other* policies in the same seed: per seed and their median,
  ``ttft_p99_ratio`` (candidate over the lowest TTFT p99, goal <= 1),
  ``ttft_p50_ratio`` (over the lowest TTFT p50, goal <= 1.05),
  ``hit_rate_ratio`` (over the highest hit rate, goal >= 0.98),
  ``decide_us_p99`` (goal <= 1000) and, on the shared-system-prompt trace,
  ``ttft_p99_over_p50`` (no collapse onto the prompt's holder: goal <= 2),
  each with whether the median meets it, and ``all_met``; for the TTFT and
  hit-rate ratios also ``of_medians``, the candidate's seed-median over the
  best other policy's seed-median, and whether it meets the goal;
- the wall time of the whole matrix.

The traces are ``bench.router``'s generators: four of the project's and two
built to break a prefix router (``bench.router_traces``: a flash crowd on
one tenant, 100-token prompts among 30k-token ones). Each trace's default
size (``TRACE_DEFAULTS``) is 800 requests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.router import GENERATORS, POLICIES, PolicyResult, ReplayConfig, build_trace, replay
from pd.workload.trace import TRACE_BLOCK_TOKENS, TraceRequest
from router.policy import PolicyConfig

# Per trace: (requests, time scale). A conversation's turns come minutes apart,
# so a trace's first few hundred requests arrive far slower than its nominal
# rate; the time scale brings them back to a pool that queues.
TRACE_DEFAULTS = {"multi_tenant": (800, 3.0), "mooncake": (800, 4.0), "long_history": (800, 3.0),
                  "system_prompt": (800, 1.0), "flash_crowd": (800, 3.0), "long_short": (800, 1.0)}
DEFAULT_TRACES = ("system_prompt", "multi_tenant", "mooncake", "long_history", "flash_crowd", "long_short")
DEFAULT_POLICIES = ("affinity", "round_robin", "ray_prefix", "latency")
DEFAULT_LOADS = (0.5, 0.75, 0.9)
# The router whose utilization a load is a fraction of: the prefix-affinity one, the default before ``latency``,
# so that a load means the same arrival rate whichever router is the default.
PILOT_POLICY = "affinity"
METRICS = ("ttft_p99_s", "ttft_p50_s", "hit_rate", "max_min_load_ratio", "decide_us_p50", "decide_us_p99")
# The routing goals: the candidate's TTFT p99 and p50 and its hit rate against the best other policy in the same
# seed, its decision's cost, and, where every prompt shares one prefix, no collapse onto its holder.
TTFT_P99_RATIO_GOAL = 1.0
TTFT_P50_RATIO_GOAL = 1.05
HIT_RATE_RATIO_GOAL = 0.98
DECIDE_US_P99_GOAL = 1000.0
COLLAPSE_GOAL = 2.0  # TTFT p99 over p50, on the shared-system-prompt trace


def machine_info() -> dict:
    """The CPU's model name and which of avx2 / avx512f it has (from ``/proc/cpuinfo`` where there is one)."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", platform.processor() or platform.machine()),
            "arch": platform.machine(), "isa": [isa for isa in ("avx2", "avx512f") if isa in flags],
            "logical_cpus": text.count("processor\t:") or None, "python": platform.python_version()}


@dataclass(frozen=True)
class SeedRun:
    """One trace at one seed, served by every policy."""

    seed: int
    working_set_over_pool: float
    cacheable_hit_rate: float
    results: dict[str, PolicyResult]


def working_set_over_pool(trace: list[TraceRequest], config: ReplayConfig) -> float:
    distinct_blocks = len({block_id for request in trace for block_id in request.hash_ids})
    return distinct_blocks / (config.num_replicas * config.cache_blocks)


def cacheable_hit_rate(trace: list[TraceRequest]) -> float:
    """The hit rate of one unbounded cache: prompt tokens in full blocks that an earlier request sent."""
    seen: set[int] = set()
    num_cacheable = 0
    for request in trace:
        num_full = request.input_length // TRACE_BLOCK_TOKENS
        num_cacheable += TRACE_BLOCK_TOKENS * sum(block_id in seen for block_id in request.hash_ids[:num_full])
        seen.update(request.hash_ids)
    return num_cacheable / max(1, sum(request.input_length for request in trace))


def seed_trace(trace_name: str, seed: int, args: argparse.Namespace) -> list[TraceRequest]:
    default_requests, _ = TRACE_DEFAULTS.get(trace_name, (0, 1.0))
    trace_args = argparse.Namespace(trace=None, generate=trace_name, requests=args.requests or default_requests,
                                    rate=args.rate, seed=seed)
    return build_trace(trace_args)[1]


def pilot_time_scales(trace_name: str, args: argparse.Namespace) -> dict[float, float]:
    """Each load's time scale: ``PILOT_POLICY``'s utilization on seed 0 at the trace's default time scale,
    scaled linearly to the load. With ``--time-scale``, that one scale, its load unknown (0)."""
    if args.time_scale:
        return {0.0: args.time_scale}
    _, default_time_scale = TRACE_DEFAULTS.get(trace_name, (0, 1.0))
    config = ReplayConfig(num_replicas=args.replicas, cache_blocks=args.cache_blocks, time_scale=default_time_scale)
    busy = replay(PILOT_POLICY, seed_trace(trace_name, 0, args), config,
                  PolicyConfig(block_size=config.block_size)).utilization
    return {load: default_time_scale * load / max(busy, 1e-3) for load in args.load_values}


def run_seed(trace_name: str, seed: int, time_scale: float, args: argparse.Namespace,
             policies: list[str]) -> SeedRun:
    trace = seed_trace(trace_name, seed, args)
    config = ReplayConfig(num_replicas=args.replicas, cache_blocks=args.cache_blocks, time_scale=time_scale,
                          seed=seed)
    pd_config = PolicyConfig(block_size=config.block_size, seed=seed)
    results = {}
    for policy in policies:
        started = time.perf_counter()
        results[policy] = replay(policy, trace, config, pd_config)
        print(f"{trace_name} x{time_scale:.2f} seed {seed} {policy}: {len(trace)} requests, "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return SeedRun(seed, working_set_over_pool(trace, config), cacheable_hit_rate(trace), results)


def metric(result: PolicyResult, name: str) -> float:
    """A result's metric; a pool where some replica got nothing has an unbounded max/min."""
    value = getattr(result, name)
    return float("inf") if value is None else value


def spread(values: list[float], digits: int = 4) -> dict:
    return {"median": finite(statistics.median(values), digits), "min": finite(min(values), digits),
            "max": finite(max(values), digits)}


def finite(value: float, digits: int = 4) -> float | None:
    """JSON has no infinity: an unbounded ratio is null."""
    return None if value == float("inf") else round(value, digits)


def policy_summary(trace_name: str, policy: str, runs: list[SeedRun]) -> dict:
    summary = {"trace": trace_name, "policy": policy, "seeds": [run.seed for run in runs]}
    for name in METRICS:
        digits = 1 if name.startswith("decide_us") else 4
        summary[name] = spread([metric(run.results[policy], name) for run in runs], digits)
    summary["utilization"] = spread([run.results[policy].utilization for run in runs], 3)
    summary["working_set_over_pool"] = spread([run.working_set_over_pool for run in runs], 3)
    summary["cacheable_hit_rate"] = spread([run.cacheable_hit_rate for run in runs])
    return summary


def seed_ratios(candidate: str, run: SeedRun) -> dict:
    """The candidate against the best of the other policies in one seed."""
    own = run.results[candidate]
    others = [result for policy, result in run.results.items() if policy != candidate]
    best_ttft_p99 = min(result.ttft_p99_s for result in others)
    best_ttft_p50 = min(result.ttft_p50_s for result in others)
    best_hit_rate = max(result.hit_rate for result in others)
    return {"ttft_p99_ratio": own.ttft_p99_s / best_ttft_p99 if best_ttft_p99 > 0 else float("inf"),
            "ttft_p50_ratio": own.ttft_p50_s / best_ttft_p50 if best_ttft_p50 > 0 else float("inf"),
            "hit_rate_ratio": own.hit_rate / best_hit_rate if best_hit_rate > 0 else 1.0,
            "decide_us_p99": own.decide_us_p99,
            "ttft_p99_over_p50": own.ttft_p99_s / own.ttft_p50_s if own.ttft_p50_s > 0 else float("inf")}


def goal_checks(trace_name: str, candidate: str, runs: list[SeedRun], num_replicas: int, load: float = 0.0) -> dict:
    per_seed = [seed_ratios(candidate, run) for run in runs]
    goals = {"ttft_p99_ratio": ("<=", TTFT_P99_RATIO_GOAL), "ttft_p50_ratio": ("<=", TTFT_P50_RATIO_GOAL),
             "hit_rate_ratio": (">=", HIT_RATE_RATIO_GOAL), "decide_us_p99": ("<=", DECIDE_US_P99_GOAL)}
    if trace_name == "system_prompt":
        goals["ttft_p99_over_p50"] = ("<=", COLLAPSE_GOAL)
    checks = {}
    for name, (sense, goal) in goals.items():
        values = [ratios[name] for ratios in per_seed]
        median = statistics.median(values)
        checks[name] = {"per_seed": [finite(value) for value in values], "median": finite(median),
                        "goal": f"{sense} {goal}", "met": median <= goal if sense == "<=" else median >= goal,
                        "seeds_met": sum(value <= goal if sense == "<=" else value >= goal for value in values)}
    baselines = sorted(policy for policy in runs[0].results if policy != candidate)
    for name, metric_name, best in (("ttft_p99_ratio", "ttft_p99_s", min), ("ttft_p50_ratio", "ttft_p50_s", min),
                                    ("hit_rate_ratio", "hit_rate", max)):
        medians = {policy: statistics.median(getattr(run.results[policy], metric_name) for run in runs)
                   for policy in runs[0].results}
        ratio = medians[candidate] / best(medians[policy] for policy in baselines) if baselines else 1.0
        sense, goal = goals[name]
        checks[name]["of_medians"] = finite(ratio)
        checks[name]["met_of_medians"] = ratio <= goal if sense == "<=" else ratio >= goal
    return {"trace": trace_name, "load": load, "candidate": candidate, "against_best_of": baselines,
            "replicas": num_replicas, "goals": checks, "all_met": all(check["met"] for check in checks.values())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_matrix", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--traces", default=",".join(DEFAULT_TRACES),
                        help="comma-separated generators of bench.router: " + ",".join(GENERATORS))
    parser.add_argument("--seeds", type=int, default=6, help="seeds 0 .. seeds-1, each a trace and a pool")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated subset of " + ",".join(POLICIES))
    parser.add_argument("--candidate", default="latency", help="the policy checked against the best of the others")
    parser.add_argument("--replicas", type=int, default=8, help="replicas in the pool (16 for the decision-cost goal)")
    parser.add_argument("--cache-blocks", type=int, default=256, help="KV per replica, in 512-token blocks")
    parser.add_argument("--requests", type=int, default=0, help="requests per trace (0: TRACE_DEFAULTS)")
    parser.add_argument("--rate", type=float, default=0.0, help="generated arrivals per second (0: the generator's)")
    parser.add_argument("--loads", default=",".join(map(str, DEFAULT_LOADS)),
                        help=f"comma-separated fractions of the pool's capacity ({PILOT_POLICY}'s utilization)")
    parser.add_argument("--time-scale", type=float, default=0.0,
                        help="arrivals come this many times faster: one load, no pilot (0: from --loads)")
    args = parser.parse_args(argv)
    args.load_values = [float(value) for value in args.loads.split(",") if value.strip()]
    if not args.load_values or min(args.load_values) <= 0:
        parser.error("--loads needs positive fractions")
    args.trace_names = [name.strip() for name in args.traces.split(",") if name.strip()]
    args.policy_names = [name.strip() for name in args.policies.split(",") if name.strip()]
    for name in args.trace_names:
        if name not in GENERATORS:
            parser.error(f"unknown trace {name!r}; expected some of {', '.join(GENERATORS)}")
    for name in args.policy_names:
        if name not in POLICIES:
            parser.error(f"unknown policy {name!r}; this bench.router has {', '.join(POLICIES)}")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    print(json.dumps({"machine": machine_info(), "replicas": args.replicas, "cache_blocks": args.cache_blocks,
                      "seeds": args.seeds, "policies": args.policy_names}), flush=True)
    for trace_name in args.trace_names:
        for load, time_scale in pilot_time_scales(trace_name, args).items():
            runs = [run_seed(trace_name, seed, time_scale, args, args.policy_names) for seed in range(args.seeds)]
            for policy in args.policy_names:
                summary = policy_summary(trace_name, policy, runs)
                print(json.dumps({"load": load, "time_scale": round(time_scale, 3), **summary}), flush=True)
            if args.candidate in args.policy_names and len(args.policy_names) > 1:
                print(json.dumps(goal_checks(trace_name, args.candidate, runs, args.replicas, load)), flush=True)
    print(json.dumps({"wall_s": round(time.perf_counter() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
