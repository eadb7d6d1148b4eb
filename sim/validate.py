"""Validate the simulator against the real app: the same arrivals, served for real and simulated.

``python -m sim.validate [--workload mixed|chat] [--rates 0.5,1,2] [--configs A.yaml B.yaml] [--duration 60]``

1. Profiles the real engine on this machine (``sim.profile``), for each
   thread count a replica of the configs computes on, while nothing else runs.
2. Serves each config for real with open-loop locust at each rate
   (``python -m loadtest.sweep``: Ray Serve, the OpenAI API, real HTTP),
   which logs every request's arrival, prompt length and timings.
3. Replays exactly those arrivals in the simulator: the same prompts (the
   workload regenerated from its seed, tokenized as the ingress does), the
   same output lengths, the config's own replicas, limits and routers, and
   one simulated deployment per config across its runs, in the order they
   ran (the real caches carry from one run to the next). A first run, at the
   first rate for ``--warmup-duration`` seconds, takes the app's one-off
   costs (in four sweeps, an app's first run, at 0.75 req/s, had a TTFT p50
   1.1-2.1x that of its third, at 1 req/s); the next, at
   ``--calibration-rate``, calibrates what a quiet-machine profile cannot see
   (``Calibration``). Both are replayed, neither is validated.
4. Summarizes both sides with the load-test report's own code
   (``loadtest.report.summarize``: the same percentiles, SLOs, cut-off rule)
   and prints one JSON object per config, rate and metric with the relative
   error ``(simulated - measured) / measured``, then a last line with the
   median absolute error of each metric across configs and rates. Writes
   ``OUT/validate.json`` and ``OUT/sim-vs-real.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from loadtest.client import CHAT_PATH
from loadtest.records import META_SUFFIX, REQUESTS_SUFFIX, RequestRecord, RunMeta, Status, read_requests
from loadtest.report import RunSummary, summarize
from loadtest.sweep import WARMUP_PREFIX
from loadtest.workloads import LoadRequest, make_workload, parse_workload_args
from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from pd.sampling_params import SamplingParams
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, SimCluster
from sim.cost import CostModel
from sim.host import HostModel
from sim.replica import RequestRecord as SimRecord
from sim.transport import LINKS

METRICS = ("ttft_p50", "e2e_p50", "goodput", "ttft_p90", "itl_p90")
REPO_ROOT = Path(__file__).resolve().parents[1]
# One Ray Serve call's overhead each way (HTTP proxy, handle call, streaming back), not profiled.
DEFAULT_CALL_S = 0.002


def prompt_token_ids(request: LoadRequest, endpoint: str, tokenizer: Tokenizer) -> list[int]:
    """The prompt the ingress made of ``request`` on ``endpoint``: the chat template, or the text as sent."""
    if endpoint == CHAT_PATH:
        return tokenizer.encode(tokenizer.apply_chat_template(request.chat_messages()), False)
    prompt = request.completion_prompt()
    return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


def metric_values(summary: RunSummary) -> dict[str, float]:
    return {"ttft_p50": summary.ttft_ms.p50, "e2e_p50": summary.e2e_ms.p50, "goodput": summary.goodput_rps,
            "ttft_p90": summary.ttft_ms.p90, "itl_p90": summary.itl_ms.p90}


def relative_error(simulated: float, measured: float) -> float:
    if measured == 0 or math.isnan(measured) or math.isnan(simulated):
        return 0.0 if simulated == measured else math.nan
    return (simulated - measured) / measured


def _as_loadtest_record(real: RequestRecord, sim: SimRecord, end_s: float, arrival_s: float,
                        delivery_s: Sequence[float] = ()) -> RequestRecord:
    """A simulated request as the load test would have logged it, cut off at the run's end.

    ``delivery_s`` (one per token, or none) delays each token on its way to
    the client, in order: a token that would overtake the one before it
    arrives with it.
    """
    delays = delivery_s or [0.0] * len(sim.token_times_s)
    if len(delays) != len(sim.token_times_s):
        raise ValueError(f"{len(delays)} delivery delays for {len(sim.token_times_s)} tokens")
    arrivals = list(itertools.accumulate((t + d for t, d in zip(sim.token_times_s, delays)), max))
    tokens = [t for t in arrivals if t <= end_s]
    done_s = max([sim.finished_s, *arrivals[-1:]]) if sim.finished_s is not None else None
    finished = done_s is not None and done_s <= end_s
    finished_s = done_s if finished else end_s
    ttft_ms = (tokens[0] - arrival_s) * 1000 if tokens else math.nan
    e2e_ms = (finished_s - arrival_s) * 1000
    tpot_ms = (e2e_ms - ttft_ms) / (len(tokens) - 1) if finished and len(tokens) > 1 else math.nan
    return RequestRecord(
        index=real.index, kind=real.kind, endpoint=real.endpoint, start_time=real.start_time,
        status=Status.OK if finished else Status.CUTOFF, ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=e2e_ms,
        prompt_tokens=sim.num_prompt_tokens, max_tokens=real.max_tokens, output_tokens=len(tokens),
        num_chunks=len(tokens), itl_ms=tuple((b - a) * 1000 for a, b in zip(tokens, tokens[1:])))


@dataclass(frozen=True)
class Run:
    """One locust run's log: ``PREFIX_requests.csv`` and ``PREFIX_meta.json``."""

    prefix: Path
    records: list[RequestRecord]
    meta: RunMeta

    @classmethod
    def read(cls, prefix: Path) -> Run:
        return cls(prefix, read_requests(str(prefix) + REQUESTS_SUFFIX), RunMeta.read(str(prefix) + META_SUFFIX))

    def summary(self, records: list[RequestRecord] | None = None) -> RunSummary:
        return summarize(self.prefix.name, self.records if records is None else records, self.meta)


def simulate_runs(runs: list[Run], spec: ClusterSpec, delivery_jitter_s: float = 0.0,
                  ) -> tuple[list[list[RequestRecord]], int]:
    """The runs' requests, each arriving when it did, on one simulated deployment; and the prompt-length mismatches.

    One deployment for all of a config's runs, in the order they ran: the
    real app's prefix caches carry from one run to the next (each run's
    workload starts again at request 0), and so do the simulated ones. Each
    token reaches the client after a delay drawn from an exponential of mean
    ``delivery_jitter_s`` (seeded by the request), in order.
    """
    tokenizer = Tokenizer.from_dir(resolve_model_path(spec.decode.engine.model))
    loop = EventLoop()
    cluster = SimCluster(loop, spec)
    origin = min(run.meta.start_time for run in runs)
    mismatched = 0
    for number, run in enumerate(runs):
        meta = run.meta
        workload = make_workload(meta.workload, meta.seed, parse_workload_args(meta.workload_args))
        for record in run.records:
            prompt = prompt_token_ids(workload.request(record.index), record.endpoint, tokenizer)
            if record.status == Status.OK and len(prompt) != record.prompt_tokens:
                mismatched += 1
            params = SamplingParams(max_tokens=record.max_tokens, ignore_eos=True)
            loop.at(record.start_time - origin, lambda request_id=f"{number}-{record.index}", prompt=prompt,
                    params=params: cluster.submit(request_id, prompt, params))
    loop.run()
    simulated = []
    for number, run in enumerate(runs):
        end_s = run.meta.end_time - origin
        records = []
        for record in run.records:
            request_id = f"{number}-{record.index}"
            sim = cluster.records[request_id]
            delays = ()
            if delivery_jitter_s:
                draw = random.Random(request_id)
                delays = [draw.expovariate(1 / delivery_jitter_s) for _ in sim.token_times_s]
            records.append(_as_loadtest_record(record, sim, end_s, record.start_time - origin, delays))
        simulated.append(records)
    return simulated, mismatched


def compare(runs: list[Run], spec: ClusterSpec, delivery_jitter_s: float = 0.0) -> list[dict]:
    """Measured and simulated metrics of each run, all simulated in one sequence."""
    started = time.perf_counter()
    simulated, mismatched = simulate_runs(runs, spec, delivery_jitter_s)
    wall_s = time.perf_counter() - started
    results = []
    for run, sim_records in zip(runs, simulated):
        real, sim = metric_values(run.summary()), metric_values(run.summary(sim_records))
        results.append({"requests": len(run.records), "prompt_length_mismatches": mismatched,
                        "sim_wall_s": round(wall_s, 2), "measured": real, "simulated": sim,
                        "error": {name: relative_error(sim[name], real[name]) for name in METRICS}})
    return results


def median_abs_errors(results: list[dict], key: str = "error") -> dict[str, float]:
    out = {}
    for name in METRICS:
        errors = [abs(r[key][name]) for r in results if key in r and not math.isnan(r[key][name])]
        out[name] = round(statistics.median(errors), 4) if errors else math.nan
    return out


def profile(model: str, threads: int, out: Path) -> CostModel:
    from bench.engine import cpu_name
    from sim.profile import measure, median_relative_error

    shapes, seconds = measure(model, threads)
    cost = CostModel.fit(shapes, seconds, f"measured: {model}, {cpu_name()}, {threads} threads, {len(shapes)} steps")
    out.write_text(cost.to_json())
    print(json.dumps({"profile_threads": threads, "fit_median_relative_error":
                      round(median_relative_error(cost, shapes, seconds), 3)}), flush=True)
    return cost


def run_sweep(configs: list[Path], rates: list[float], duration_s: float, warmup_s: float, workload: str,
              out: Path, extra: list[str]) -> None:
    command = [sys.executable, "-m", "loadtest.sweep", "--configs", *map(str, configs),
               "--rates", ",".join(f"{rate:g}" for rate in rates), "--duration", f"{duration_s:g}",
               "--warmup-duration", f"{warmup_s:g}", "--out", str(out), "--workload", workload, *extra]
    subprocess.run(command, cwd=REPO_ROOT, check=True, stdout=sys.stderr)


def write_plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ("ttft_p50", "ttft_p90", "e2e_p50", "itl_p90")
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for config in sorted({r["config"] for r in results}):
        rows = sorted((r for r in results if r["config"] == config), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        for axis, name in zip(axes, panels):
            line, = axis.plot(rates, [r["measured"][name] for r in rows], marker="o", label=f"{config} measured")
            axis.plot(rates, [r["simulated"][name] for r in rows], marker="x", linestyle="--", color=line.get_color(),
                      label=f"{config} simulated")
            axis.set_title(name.replace("_", " ") + " (ms)")
            axis.set_xlabel("offered load (req/s)")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@dataclass(frozen=True)
class Calibration:
    """What the profile does not see of the served app.

    Its replicas spend ``step_s`` more on each step and ``token_s`` on each
    token a step samples, serially with their steps: the replica's event
    loop takes each step's outputs and streams every token through Ray,
    sharing the process (and its GIL) with the step thread. Its engines share
    the machine's cores with the HTTP proxy, the ingress and the load
    generator, which spend ``cpu_per_token_s`` on each streamed token
    (``sim.host``); the ingress spends ``ingress_s`` on a request before
    it places it (parsing, chat template, tokens, hashes); and each token
    reaches the client after a delay of mean ``jitter_s`` on its way through
    the ingress, the proxy and the client, which share two busy cores: it
    spreads the gaps between tokens (and delivers some together) without
    slowing the engine.
    """

    step_s: float = 0.0
    token_s: float = 0.0
    ingress_s: float = 0.0
    cpu_per_token_s: float = 0.0
    jitter_s: float = 0.0


# What the proxy, the ingress and the client spend on a streamed token, measured from /proc on one stream on
# this class of 2-core host: ingress 1.5-2.2 ms, proxy 0.9-1.3 ms, locust the rest.
DEFAULT_CPU_PER_TOKEN_S = 0.004
# A number of concurrent streams enters the ITL line with at least this many gaps measured at it.
MIN_GAPS_PER_STREAM_COUNT = 50


def itl_by_streams(records: Sequence[RequestRecord]) -> dict[int, float]:
    """The median gap between two tokens (ms) for each number of streams that were decoding when it ended.

    A stream decodes from its first token to its last; the count is the
    client's view, from the records alone, so the measured and the
    simulated runs are counted alike.
    """
    done = [r for r in records if r.status == Status.OK and r.itl_ms]
    if not done:
        return {}
    first = np.sort([r.start_time + r.ttft_ms / 1000 for r in done])
    last = np.sort([r.start_time + r.e2e_ms / 1000 for r in done])
    times, gaps = [], []
    for record in done:
        ends = record.start_time + (record.ttft_ms + np.cumsum(record.itl_ms)) / 1000
        times.append(ends)
        gaps.append(np.asarray(record.itl_ms))
    times, gaps = np.concatenate(times), np.concatenate(gaps)
    streams = np.searchsorted(first, times, side="right") - np.searchsorted(last, times, side="left")
    return {int(n): float(np.median(gaps[streams == n])) for n in np.unique(streams)
            if n > 0 and (streams == n).sum() >= MIN_GAPS_PER_STREAM_COUNT}


@dataclass(frozen=True)
class ItlLine:
    """``itl_by_streams`` as ``intercept_ms + slope_ms * streams`` (least squares; no slope from one point),
    from ``first`` streams up."""

    intercept_ms: float
    slope_ms: float | None
    first: int

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> ItlLine | None:
        points = itl_by_streams(records)
        if not points:
            return None
        if len(points) == 1:
            (count, gap), = points.items()
            return cls(gap, None, count)
        slope, intercept = np.polyfit(list(points), list(points.values()), 1)
        return cls(float(intercept), float(slope), min(points))

    def at(self, streams: int) -> float:
        return self.intercept_ms + (self.slope_ms or 0.0) * streams


def _fit_overheads_and_ingress(run: Run, spec_for: Callable[[Calibration], ClusterSpec], cpu_per_token_s: float,
                               iterations: int, before: Sequence[Run]) -> tuple[Calibration, RunSummary]:
    """The gaps between tokens, against the streams decoding, set the step's and the token's overheads;
    what TTFT p50 still misses is the ingress's."""
    measured = run.summary()
    line = ItlLine.of(run.records)
    calibration = Calibration(cpu_per_token_s=cpu_per_token_s)
    for _ in range(iterations):
        records = simulate_runs([*before, run], spec_for(calibration), calibration.jitter_s)[0][-1]
        simulated = run.summary(records)
        sim_line = ItlLine.of(records)
        step_s, token_s = calibration.step_s, calibration.token_s
        if line is not None and sim_line is not None:
            if line.slope_ms is not None and sim_line.slope_ms is not None:
                token_s = max(0.0, token_s + (line.slope_ms - sim_line.slope_ms) / 1000)
            # a step of n streams samples n tokens: the step's overhead takes what the tokens' does not
            missed_s = (line.at(line.first) - sim_line.at(line.first)) / 1000
            step_s = max(0.0, step_s + missed_s - line.first * (token_s - calibration.token_s))
        ingress_s = max(0.0, calibration.ingress_s + (measured.ttft_ms.p50 - simulated.ttft_ms.p50) / 1000)
        # the spread of the gaps, p90 over p50, is the delivery's: a difference of two exponential delays
        # of mean m has its p90 1.6 m past its median
        spread_missed_ms = ((measured.itl_ms.p90 - measured.itl_ms.p50) - (simulated.itl_ms.p90 - simulated.itl_ms.p50))
        jitter_s = max(0.0, calibration.jitter_s + spread_missed_ms / 1.6 / 1000)
        calibration = Calibration(step_s, token_s, ingress_s, cpu_per_token_s, jitter_s)
    records = simulate_runs([*before, run], spec_for(calibration), calibration.jitter_s)[0][-1]
    return calibration, run.summary(records)


def calibrate(run: Run, spec_for: Callable[[Calibration], ClusterSpec], iterations: int = 4,
              before: Sequence[Run] = (), cpu_per_token_s: float = DEFAULT_CPU_PER_TOKEN_S) -> Calibration:
    """The calibration that makes one run's gaps between tokens, their spread and TTFT p50 match.

    The replicas' overheads are fitted to the median gap between tokens at
    each number of streams decoding (``ItlLine``), the ingress time to TTFT
    p50 and the delivery's jitter to the gaps' spread (p90 less p50). The
    rest of the path's CPU per token is given, not fitted: one run at a light
    load cannot tell it from the jitter (an earlier calibration searched a
    grid of it for the closest ITL p90; with the jitter fitted, every value
    of the grid matched, and the choice was noise). From a run at a rate
    that is not validated. ``before`` are the runs the app served before it,
    replayed first as the comparison replays them: their prompts warm the
    simulated caches as they warmed the real ones.
    """
    return _fit_overheads_and_ingress(run, spec_for, cpu_per_token_s, iterations, before)[0]


def calibrated_spec(args: dict, cost_for_threads: Callable[[int], CostModel], calibration: Calibration,
                    call_s: float, why: str = "served") -> ClusterSpec:
    """The app of ``args`` as served on this machine: its steps' overheads added, its ingress timed, its host's
    cores shared."""
    from sim.deployment import cluster_spec

    def cost(threads: int) -> CostModel:
        measured = cost_for_threads(threads)
        if not calibration.step_s and not calibration.token_s:
            return measured
        return measured.with_overhead(calibration.step_s, calibration.token_s, why)

    spec = cluster_spec(args, cost, LINKS["loopback"], call_s=call_s)
    host = HostModel(os.cpu_count() or 1, calibration.cpu_per_token_s) if calibration.cpu_per_token_s else None
    return dataclasses.replace(spec, ingress_s=calibration.ingress_s, host=host)


def served_runs(directory: Path, rates: list[float], calibration_rate: float | None,
                ) -> tuple[list[Run], Run | None, list[Run]]:
    """A config's runs in the order they were served, its calibration run (if any), and the validated ones.

    Every run under ``directory`` that the sweep made is served and replayed:
    the warm-up (``WARMUP_PREFIX``), the calibration run, the validated rates.
    """
    validated = [Run.read(directory / f"rate-{rate:g}") for rate in rates]
    served_first = [Run.read(path.parent / path.name.removesuffix(REQUESTS_SUFFIX))
                    for path in directory.glob(f"{WARMUP_PREFIX}*{REQUESTS_SUFFIX}")]
    calibration_run = None
    if calibration_rate is not None:
        calibration_run = Run.read(directory / f"rate-{calibration_rate:g}")
        served_first.append(calibration_run)
    return sorted([*served_first, *validated], key=lambda run: run.meta.start_time), calibration_run, validated


def validate(configs: list[Path], rates: list[float], calibration_rate: float | None, out: Path,
             costs: dict[int, CostModel], call_s: float, cpu_per_token_s: float = DEFAULT_CPU_PER_TOKEN_S,
             ) -> list[dict]:
    """Compare every run under ``out/real`` with its simulation; one JSON line per config, rate and metric."""
    import yaml

    results = []
    for config in configs:
        args = yaml.safe_load(config.read_text())["applications"][0]["args"]

        def spec_for(calibration: Calibration) -> ClusterSpec:
            why = f"served {config.stem} at {calibration_rate:g} req/s" if calibration_rate else "served"
            return calibrated_spec(args, costs.__getitem__, calibration, call_s, why)

        runs, calibration_run, validated = served_runs(out / "real" / config.stem, rates, calibration_rate)
        calibration = Calibration()
        if calibration_run is not None:
            calibration = calibrate(calibration_run, spec_for, before=[
                run for run in runs if run.meta.start_time < calibration_run.meta.start_time],
                cpu_per_token_s=cpu_per_token_s)
            print(json.dumps({"config": config.stem, "calibration_rate": calibration_rate,
                              **dataclasses.asdict(calibration)}), flush=True)
        compared = compare(runs, spec_for(calibration), calibration.jitter_s)
        uncalibrated = compare(runs, spec_for(Calibration())) if calibration != Calibration() else compared
        validated_ids = {id(run) for run in validated}
        for run, result, plain in zip(runs, compared, uncalibrated):
            if id(run) not in validated_ids:  # the warm-up and calibration runs: served and simulated only
                continue
            rate = run.meta.arrival_rate
            result = {"config": config.stem, "rate": rate, **dataclasses.asdict(calibration), **result,
                      "uncalibrated_error": plain["error"]}
            results.append(result)
            for name in METRICS:
                print(json.dumps({"config": config.stem, "rate": rate, "metric": name,
                                  "measured": result["measured"][name], "simulated": result["simulated"][name],
                                  "error": result["error"][name]}), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("mixed", "chat"), default="mixed")
    parser.add_argument("--rates", default="0.5,1,2", help="offered loads in requests/s, comma-separated")
    parser.add_argument("--configs", nargs="+", default=["serve_configs/default.yaml", "serve_configs/colocated.yaml"])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per rate")
    parser.add_argument("--out", help="output directory (default sim-validate-<time>)")
    parser.add_argument("--call-ms", type=float, default=DEFAULT_CALL_S * 1000,
                        help="modelled overhead of one Serve call, each way")
    parser.add_argument("--calibration-rate", type=float, default=0.75,
                        help="one more rate, run first and not validated, that calibrates each config "
                             "(see Calibration; 0: none, the quiet-machine profile as measured)")
    parser.add_argument("--warmup-duration", type=float, default=30.0,
                        help="seconds of a first run at the first rate, served and simulated but neither "
                             "calibrated on nor validated (a freshly deployed app serves its first minute slower; "
                             "0: none)")
    parser.add_argument("--cpu-per-token-ms", type=float, default=DEFAULT_CPU_PER_TOKEN_S * 1000,
                        help="CPU the HTTP proxy, the ingress and the client spend on each streamed token, on the "
                             "cores the engines compute on (sim.host; 0: none)")
    parser.add_argument("--reuse", action="store_true", help="compare the runs already under OUT/real")
    args, sweep_extra = parser.parse_known_args(argv)
    rates = [float(rate) for rate in args.rates.split(",") if rate.strip()]
    if args.calibration_rate in rates:
        parser.error(f"--calibration-rate {args.calibration_rate:g} is also in --rates: a run calibrated on "
                     "is not validated")
    configs = [Path(path).resolve() for path in args.configs]
    out = Path(args.out or f"sim-validate-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)

    import yaml

    from pd.serve.args import AppArgs
    from sim.deployment import pool_decode_threads, pool_threads

    apps = [AppArgs.parse(yaml.safe_load(path.read_text())["applications"][0]["args"]) for path in configs]
    threads = sorted({count for app in apps for pool in (app.decode, app.prefill)
                      for count in (pool_threads(pool, app.engine_config()),
                                    pool_decode_threads(pool, app.engine_config()))})
    models = {app.engine.model for app in apps}
    if len(models) != 1:
        raise SystemExit(f"the configs serve different models: {sorted(models)}")
    costs = {}
    for count in threads:  # before any load runs: the profile owns the machine
        path = out / f"profile-{count}-threads.json"
        reused = args.reuse and path.exists()
        costs[count] = CostModel.load(path) if reused else profile(apps[0].engine.model, count, path)
    calibration = args.calibration_rate or None
    if not args.reuse:
        run_sweep(configs, ([calibration] if calibration else []) + rates, args.duration, args.warmup_duration,
                  args.workload, out / "real", sweep_extra)
    results = validate(configs, rates, calibration, out, costs, args.call_ms / 1000, args.cpu_per_token_ms / 1000)
    summary = {"summary": True, "median_abs_error": median_abs_errors(results)}
    if calibration:
        summary["uncalibrated_median_abs_error"] = median_abs_errors(results, "uncalibrated_error")
    (out / "validate.json").write_text(json.dumps({"workload": args.workload, "results": results, **summary}, indent=1))
    write_plot(results, out / "sim-vs-real.png")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
