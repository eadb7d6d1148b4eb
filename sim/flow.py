"""Replay overload through the app's flow control in simulated time: ``python -m sim.flow``.

The deployment is the default app's shape, disaggregated with one prefill
and one decode replica, real engines priced by a fixed step cost
(``default_spec``), the app's routers (the predicted-latency one on the
prefill pool), and the ingress's ``FlowController`` in front
(``sim.flow_gate``). Three tenants of equal weight, ``a``, ``b`` and ``c``;
``c`` sends 70% of the requests; ``--interactive-share`` (30%) of each
tenant's are interactive (priority 0, TTFT deadline 2 s), the rest batch
(priority 1, none).

Runs, each printed as one JSON line (``sim.flow_report``: per tenant and
band, offered, served, shed, TTFT p50/p99, goodput; Jain's index):

1. ``capacity``: the most requests per second the deployment finishes,
   over a sweep of offered rates without flow control.
2. ``overload``: 2x capacity with flow control; the same trace without
   shedding (``no_shed``), without flow control (``no_flow_control``), and
   its interactive requests alone (``load_off``). ``pressure``: the same
   with 80% interactive, more interactive work than capacity, so that
   deadlines are what sheds.
3. ``moderate``: 0.7x capacity, with and without flow control.
4. ``quota``: ``c`` alone at 2x capacity with a quota of a third of
   capacity, ``a`` and ``b`` joining at ``--quota-return-s`` (the trace's
   mix from then on): how far over its quota ``c`` is served while alone,
   and how soon ``a`` and ``b`` are served what they ask (``recovery_s``).

The last line, ``goals``, sets the figures against issue 58's goals 1-4.
``--plot PATH`` draws the 2x run's interactive TTFT p99 over time and the
quota run's tenants (``sim.flow_plot``).
Every figure is simulated, not measured on the served app.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
from collections import Counter
from pathlib import Path

from pd.config import EngineConfig
from router.flow_config import Band, FlowConfig, SaturationConfig, Tenant, key_digest
from router.flow_control import ShedReason
from sim.cluster import ClusterSpec, PoolSpec
from sim.cost import CostModel
from sim.flow_plot import plot
from sim.flow_report import Window, summarize
from sim.flow_trace import FlowRun, FlowTraceConfig, api_key, generate, replay
from sim.transport import TransferModel

TENANTS = ("a", "b", "c")
INTERACTIVE_DEADLINE_S = 2.0
WARMUP_S = 10.0
CAPACITY_SWEEP_RPS = (20.0, 25.0, 30.0, 35.0, 40.0, 50.0)


def default_spec(seed: int = 0) -> ClusterSpec:
    """One prefill and one decode replica of a small engine, priced by a fixed step cost."""
    cost = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-7, per_seq_s=2e-4, per_sample_s=1e-4)
    engine = EngineConfig(model="builtin:tiny-llama", block_size=16, num_blocks=4096, max_num_batched_tokens=512,
                          max_num_seqs=64)
    link = TransferModel(per_transfer_s=1e-3, per_descriptor_s=1e-5, bytes_per_s=2e9)
    return ClusterSpec(decode=PoolSpec(1, engine, cost), prefill=PoolSpec(1, engine, cost), transfer=link,
                       call_s=0.001, seed=seed)


def default_flow(quota_c_tokens_per_min: int | None = None, shedding: bool = True) -> FlowConfig:
    """Two bands (interactive: priority <= 0, 2 s; batch), three tenants of equal weight identified by key.
    Without ``shedding``, nothing is shed (no margin, no bound): the replay that shows what shedding spared."""
    unbounded = 1 << 30
    tenants = tuple(Tenant(name, quota_tokens_per_min=quota_c_tokens_per_min if name == "c" else None,
                           max_queued=256 if shedding else unbounded) for name in TENANTS)
    return FlowConfig(bands=(Band("interactive", None, 0, INTERACTIVE_DEADLINE_S), Band("batch", 1, None)),
                      tenants=tenants, default_tenant="a", shed_margin=0.1 if shedding else math.inf,
                      max_queued=4096 if shedding else unbounded, saturation=SaturationConfig(),
                      key_tenants={key_digest(api_key(name)): name for name in TENANTS})


def measure_capacity(spec: ClusterSpec, duration_s: float, seed: int,
                     rates: tuple[float, ...] = CAPACITY_SWEEP_RPS) -> dict:
    """The most requests (and tokens) per second finished in a window, over offered ``rates``."""
    window = Window(WARMUP_S, duration_s)
    best = {"requests_per_s": 0.0, "tokens_per_s": 0.0, "at_offered_rps": None}
    for rate in rates:
        run = replay(spec, generate(FlowTraceConfig(rate_rps=rate, duration_s=duration_s, seed=seed)))
        done = [(arrival, record) for arrival in run.arrivals
                if window.holds((record := run.records[arrival.request_id]).finished_s)]
        requests = len(done) / window.span_s
        if requests > best["requests_per_s"]:
            tokens = sum(len(arrival.prompt) + len(record.token_times_s) for arrival, record in done) / window.span_s
            best = {"requests_per_s": round(requests, 2), "tokens_per_s": round(tokens, 1), "at_offered_rps": rate}
    return best


def drain_check(run: FlowRun) -> dict:
    """Each shed's predicted queue drain against the drain seen: the time until the tokens dispatched after it
    reached the tokens that were ahead of it."""
    admissions = run.gate.admissions
    times = [time_s for time_s, _ in admissions]
    totals = list(itertools.accumulate(tokens for _, tokens in admissions))
    ratios, unknown = [], 0
    for outcome in run.gate.outcomes.values():
        shed = outcome.shed
        if shed is None or shed.tokens_ahead <= 0:
            continue
        if shed.queue_drain_s is None:
            unknown += 1
            continue
        start = bisect.bisect_right(times, outcome.decided_s)
        before = totals[start - 1] if start else 0
        done = bisect.bisect_left(totals, before + shed.tokens_ahead, lo=start)
        actual = times[done] - outcome.decided_s if done < len(times) else math.inf
        ratios.append(shed.queue_drain_s / actual if actual > 0 else math.inf)
    within = sum(0.5 <= ratio <= 2.0 for ratio in ratios)
    return {"checked": len(ratios), "no_rate_yet": unknown,
            "within_2x": round(within / len(ratios), 3) if ratios else None,
            "median_ratio": round(sorted(ratios)[len(ratios) // 2], 3) if ratios else None}


def shed_figures(run: FlowRun, no_shed: FlowRun) -> dict:
    """How fast sheds were answered (per reason), and whether the deadline ones would have missed without
    shedding (their TTFT in the replay without it, or no token at all)."""
    sheds = [(outcome, outcome.shed) for outcome in run.gate.outcomes.values() if outcome.shed is not None]
    fast: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for outcome, shed in sheds:
        count[shed.reason.value] += 1
        fast[shed.reason.value] += outcome.decided_s - shed.request.arrival_s <= 0.05
    by_deadline = [shed for _, shed in sheds if shed.reason in (ShedReason.DEADLINE, ShedReason.EXPIRED)]
    missed = 0
    for shed in by_deadline:
        record = no_shed.records[shed.request.request_id]
        missed += not record.token_times_s or record.ttft_s > shed.request.deadline_s
    return {"shed": len(sheds), "by_reason": dict(sorted(count.items())),
            "within_50ms": round(sum(fast.values()) / len(sheds), 3) if sheds else None,
            "within_50ms_by_reason": {reason: round(fast[reason] / count[reason], 3) for reason in sorted(count)},
            "deadline_shed": len(by_deadline),
            "would_have_missed": round(missed / len(by_deadline), 3) if by_deadline else None,
            "retry_after": drain_check(run)}


def overload(spec: ClusterSpec, capacity_rps: float, duration_s: float, seed: int, factor: float = 2.0,
             interactive_share: float = 0.3, baselines: bool = True, keep: dict | None = None) -> dict:
    """The figures of each run; ``keep``, where given, gets the runs themselves (``--plot``)."""
    trace = generate(FlowTraceConfig(rate_rps=factor * capacity_rps, duration_s=duration_s, seed=seed,
                                     interactive_share=interactive_share))
    window = Window(WARMUP_S, duration_s)
    runs = {"flow_control": replay(spec, trace, default_flow()),
            "no_shed": replay(spec, trace, default_flow(shedding=False))}
    if baselines:
        runs["no_flow_control"] = replay(spec, trace)
        runs["load_off"] = replay(spec, [arrival for arrival in trace if arrival.interactive])
    if keep is not None:
        keep.update(runs)
    out = {name: summarize(run, window, INTERACTIVE_DEADLINE_S) for name, run in runs.items()}
    out["shedding"] = shed_figures(runs["flow_control"], runs["no_shed"])
    return out


def moderate(spec: ClusterSpec, capacity_rps: float, duration_s: float, seed: int, factor: float = 0.7) -> dict:
    trace = generate(FlowTraceConfig(rate_rps=factor * capacity_rps, duration_s=duration_s, seed=seed))
    window = Window(WARMUP_S, duration_s)
    return {"flow_control": summarize(replay(spec, trace, default_flow()), window, INTERACTIVE_DEADLINE_S),
            "no_flow_control": summarize(replay(spec, trace), window, INTERACTIVE_DEADLINE_S)}


def quota(spec: ClusterSpec, capacity: dict, duration_s: float, return_s: float, seed: int,
          keep: dict | None = None) -> dict:
    """``c`` alone, over its quota of a third of capacity, then ``a`` and ``b`` from ``return_s``; ``keep``, where
    given, gets the run (``--plot``)."""
    quota_per_min = int(capacity["tokens_per_s"] * 60 / 3)
    config = FlowTraceConfig(rate_rps=2 * capacity["requests_per_s"], duration_s=duration_s, seed=seed,
                             active=(("a", return_s, math.inf), ("b", return_s, math.inf)))
    trace = generate(config)
    run = replay(spec, trace, default_flow(quota_c_tokens_per_min=quota_per_min))
    if keep is not None:
        keep["quota"] = run
    return quota_figures(run, quota_per_min, return_s, duration_s)


def quota_figures(run: FlowRun, quota_per_min: int, return_s: float, duration_s: float) -> dict:
    """How far over its quota ``c`` was served alone, and how soon ``a`` and ``b`` had their share back
    (``bench.flow_control`` reads a served run with it too)."""
    alone = _served_tokens(run, "c", WARMUP_S, return_s) / (return_s - WARMUP_S)
    return {"quota_c_tokens_per_s": round(quota_per_min / 60, 1), "c_alone_tokens_per_s": round(alone, 1),
            "c_alone_over_quota": round(alone / (quota_per_min / 60), 3),
            "recovery_s": _recovery_s(run, return_s, duration_s),
            "after_return": summarize(run, Window(return_s + 10.0, duration_s), INTERACTIVE_DEADLINE_S)}


def _served_tokens(run: FlowRun, tenant: str, start_s: float, end_s: float) -> float:
    return sum(len(arrival.prompt) + len(record.token_times_s) for arrival in run.arrivals
               if arrival.tenant == tenant and (record := run.records[arrival.request_id]).token_times_s
               and start_s <= record.token_times_s[0] < end_s)


def _recovery_s(run: FlowRun, return_s: float, end_s: float, span_s: float = 5.0, step_s: float = 0.5) -> float | None:
    """From ``return_s`` to the end of the first ``span_s`` over which ``a`` and ``b`` were each served at
    least 90% of the tokens they offered in it (their share: they ask less than a third)."""
    start = return_s
    while start + span_s <= end_s:
        if all(_served_tokens(run, tenant, start, start + span_s) >= 0.9 * sum(
                arrival.cost for arrival in run.arrivals
                if arrival.tenant == tenant and start <= arrival.time_s < start + span_s) for tenant in ("a", "b")):
            return round(start + span_s - return_s, 2)
        start += step_s
    return None


def goals(over: dict, pressure: dict, mod: dict, quota_run: dict) -> dict:
    flow, off = over["flow_control"]["groups"], over["load_off"]["groups"]
    interactive = flow["band:interactive"]
    fairness = over["flow_control"]["fairness"]
    shedding = over["shedding"]
    mod_flow, mod_none = mod["flow_control"]["groups"]["all"], mod["no_flow_control"]["groups"]["all"]

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    return {
        "1_interactive_ttft_p99_s": interactive["ttft_p99_s"],
        "1_interactive_goodput_vs_load_off": ratio(interactive["goodput_rps"], off["band:interactive"]["goodput_rps"]),
        "1_interactive_admitted_past_deadline": interactive["missed_deadline"],
        "1_interactive_shed": interactive["shed"],
        "2_jain_per_band": fairness["jain_per_band"],
        "2_jain_backlogged": fairness["jain_backlogged"],
        "2_jain_max_min": fairness["jain_max_min"],
        "2_served_share": fairness["served_share"],
        "2_c_alone_over_quota": quota_run["c_alone_over_quota"],
        "2_recovery_s": quota_run["recovery_s"],
        "3_shed_within_50ms": shedding["within_50ms"],
        "3_shed_within_50ms_by_reason": shedding["within_50ms_by_reason"],
        "3_retry_after_within_2x": shedding["retry_after"]["within_2x"],
        "3_pressure_interactive_ttft_p99_s": pressure["flow_control"]["groups"]["band:interactive"]["ttft_p99_s"],
        "3_pressure_shed_within_50ms_by_reason": pressure["shedding"]["within_50ms_by_reason"],
        "3_pressure_deadline_shed": pressure["shedding"]["deadline_shed"],
        "3_pressure_deadline_shed_would_have_missed": pressure["shedding"]["would_have_missed"],
        "3_pressure_retry_after_within_2x": pressure["shedding"]["retry_after"]["within_2x"],
        "4_shed_at_0.7x": mod_flow["shed"],
        "4_ttft_p50_vs_no_flow_control": ratio(mod_flow["ttft_p50_s"], mod_none["ttft_p50_s"]),
        "4_ttft_p99_vs_no_flow_control": ratio(mod_flow["ttft_p99_s"], mod_none["ttft_p99_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--capacity-rps", type=float, default=None, help="skip the sweep: requests/s")
    parser.add_argument("--capacity-tokens-per-s", type=float, default=None, help="with --capacity-rps")
    parser.add_argument("--quota-return-s", type=float, default=40.0)
    parser.add_argument("--quota-duration-s", type=float, default=80.0)
    parser.add_argument("--interactive-share", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None,
                        help="a PNG: the interactive TTFT p99 at 2x and the quota run's tenants (sim.flow_plot)")
    args = parser.parse_args()
    spec = default_spec(args.seed)
    if args.capacity_rps is not None:
        if args.capacity_tokens_per_s is None:
            parser.error("--capacity-rps needs --capacity-tokens-per-s")
        capacity = {"requests_per_s": args.capacity_rps, "tokens_per_s": args.capacity_tokens_per_s}
    else:
        capacity = measure_capacity(spec, args.duration_s, args.seed)
    print(json.dumps({"run": "capacity", **capacity}))
    runs: dict = {}
    over = overload(spec, capacity["requests_per_s"], args.duration_s, args.seed,
                    interactive_share=args.interactive_share, keep=runs)
    for name, figures in over.items():
        print(json.dumps({"run": f"overload/{name}", **figures}))
    pressure = overload(spec, capacity["requests_per_s"], args.duration_s, args.seed, interactive_share=0.8,
                        baselines=False)
    for name, figures in pressure.items():
        print(json.dumps({"run": f"pressure/{name}", **figures}))
    mod = moderate(spec, capacity["requests_per_s"], args.duration_s, args.seed)
    for name, figures in mod.items():
        print(json.dumps({"run": f"moderate/{name}", **figures}))
    quota_run = quota(spec, capacity, args.quota_duration_s, args.quota_return_s, args.seed, keep=runs)
    print(json.dumps({"run": "quota", **quota_run}))
    if args.plot is not None:
        plot(runs, runs.pop("quota"), quota_run["quota_c_tokens_per_s"], args.quota_return_s, INTERACTIVE_DEADLINE_S,
             args.plot)
    print(json.dumps({"run": "goals", **goals(over, pressure, mod, quota_run)}))


if __name__ == "__main__":
    main()

