"""Validate the simulator against the real app: the same arrivals, served for real and simulated.

``python -m sim.validate [--workload mixed|chat] [--rates 0.5,1,2] [--configs A.yaml B.yaml] [--model M] [--duration 60]``

1. Profiles the real engine on this machine (``sim.profile``), for each
   thread count a replica of the configs computes on, while nothing else runs.
2. Serves each config for real with open-loop locust at each rate
   (``python -m loadtest.sweep``: Ray Serve, the OpenAI API, real HTTP),
   which logs every request's arrival, prompt length and timings.
3. Replays exactly those arrivals in the simulator (``sim.replay``): the
   same prompts (the workload regenerated from its seed, tokenized as the
   ingress does), the same output lengths, the config's own replicas, limits and routers, and
   one simulated deployment per config across its runs, in the order they
   ran (the real caches carry from one run to the next). A first run, at the
   first rate for ``--warmup-duration`` seconds, takes the app's one-off
   costs (in four sweeps, an app's first run, at 0.75 req/s, had a TTFT p50
   1.1-2.1x that of its third, at 1 req/s); the next, at
   ``--calibration-rate`` (one rate, or several: the lightest first),
   calibrates what a quiet-machine profile cannot see (``sim.calibration``).
   They are replayed, not validated.
4. Summarizes both sides with the load-test report's own code
   (``pd.workload.summary``: the same percentiles, SLOs, cut-off rule)
   and prints one JSON object per config, rate and metric with the relative
   error ``(simulated - measured) / measured``, then a last line with the
   median absolute error of each metric across configs and rates. Writes
   ``OUT/validate.json`` and ``OUT/sim-vs-real.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from pd.workload.records import REQUESTS_SUFFIX
from pd.workload.summary import RunSummary
from sim.calibration import DEFAULT_CPU_PER_TOKEN_S, Calibration, calibrate, calibrated_spec
from sim.cluster import ClusterSpec
from sim.cost import CostModel
from sim.replay import Run, simulate_runs

METRICS = ("ttft_p50", "e2e_p50", "goodput", "ttft_p90", "itl_p90")
REPO_ROOT = Path(__file__).resolve().parents[1]
# One Ray Serve call's overhead each way (HTTP proxy, handle call, streaming back), not profiled.
DEFAULT_CALL_S = 0.002


def metric_values(summary: RunSummary) -> dict[str, float]:
    return {"ttft_p50": summary.ttft_ms.p50, "e2e_p50": summary.e2e_ms.p50, "goodput": summary.goodput_rps,
            "ttft_p90": summary.ttft_ms.p90, "itl_p90": summary.itl_ms.p90}


def relative_error(simulated: float, measured: float) -> float:
    if measured == 0 or math.isnan(measured) or math.isnan(simulated):
        return 0.0 if simulated == measured else math.nan
    return (simulated - measured) / measured


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
    from pd.workload.host import cpu_name
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


def served_runs(directory: Path, rates: list[float], calibration_rates: Sequence[float] = (),
                ) -> tuple[list[Run], list[Run], list[Run]]:
    """A config's runs in the order they were served, its calibration runs (in the order given), and the validated
    ones.

    Every run under ``directory`` that the sweep made is replayed, as it was
    served: the warm-up (``loadtest.sweep.WARMUP_PREFIX``), the calibration runs, the
    validated rates, and any other rate the sweep served (its prompts warmed
    the real caches too).
    """
    prefixes = [path.with_name(path.name.removesuffix(REQUESTS_SUFFIX))
                for path in directory.glob(f"*{REQUESTS_SUFFIX}")]
    served = {prefix.name: Run.read(prefix) for prefix in prefixes}

    def at(rate: float) -> Run:
        name = f"rate-{rate:g}"
        if name not in served:
            raise FileNotFoundError(f"no run at {rate:g} req/s under {directory} ({name}{REQUESTS_SUFFIX})")
        return served[name]

    validated = [at(rate) for rate in rates]
    calibration_runs = [at(rate) for rate in calibration_rates]
    return sorted(served.values(), key=lambda run: run.meta.start_time), calibration_runs, validated


def validate(configs: list[Path], rates: list[float], calibration_rates: Sequence[float], out: Path,
             costs: dict[int, CostModel], call_s: float, cpu_per_token_s: float = DEFAULT_CPU_PER_TOKEN_S,
             ) -> list[dict]:
    """Compare every run under ``out/real`` with its simulation; one JSON line per config, rate and metric."""
    import yaml

    results = []
    for config in configs:
        args = yaml.safe_load(config.read_text())["applications"][0]["args"]

        def spec_for(calibration: Calibration) -> ClusterSpec:
            why = (f"served {config.stem} at {', '.join(f'{rate:g}' for rate in calibration_rates)} req/s"
                   if calibration_rates else "served")
            return calibrated_spec(args, costs.__getitem__, calibration, call_s, why)

        runs, calibration_runs, validated = served_runs(out / "real" / config.stem, rates, calibration_rates)
        calibration = Calibration()
        if calibration_runs:
            first = min(run.meta.start_time for run in calibration_runs)
            calibration = calibrate(calibration_runs, spec_for, before=[
                run for run in runs if run.meta.start_time < first], cpu_per_token_s=cpu_per_token_s)
            print(json.dumps({"config": config.stem, "calibration_rates": list(calibration_rates),
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


DEFAULT_CONFIGS = ("serve_configs/default.yaml", "serve_configs/colocated.yaml")
# What the default configs serve here: default.yaml's SmolLM2 is for `make serve`, colocated.yaml's the tiny model.
DEFAULT_MODEL = "builtin:tiny-llama"


def with_model(configs: list[Path], model: str, directory: Path) -> list[Path]:
    """Copies of ``configs`` in ``directory`` (same file names) whose one app serves ``model``."""
    import yaml

    if len({path.name for path in configs}) != len(configs):
        raise SystemExit(f"--model writes each config under its file name, and two share one: {configs}")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for path in configs:
        config = yaml.safe_load(path.read_text())
        config["applications"][0]["args"]["engine"]["model"] = model
        written.append(directory / path.name)
        written[-1].write_text(yaml.safe_dump(config, sort_keys=False))
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("mixed", "chat"), default="mixed")
    parser.add_argument("--rates", default="0.5,1,2", help="offered loads in requests/s, comma-separated")
    parser.add_argument("--configs", nargs="+", help=f"default: {' '.join(DEFAULT_CONFIGS)}")
    parser.add_argument("--model", help="serve this model in every config (copies under OUT/configs/); default: "
                                        f"{DEFAULT_MODEL} with the default configs, else each config's own")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per rate")
    parser.add_argument("--out", help="output directory (default sim-validate-<time>)")
    parser.add_argument("--call-ms", type=float, default=DEFAULT_CALL_S * 1000,
                        help="modelled overhead of one Serve call, each way")
    parser.add_argument("--calibration-rate", default="0.75",
                        help="one more rate, or several comma-separated (the lightest first), run first and not "
                             "validated, that calibrate each config (see Calibration; 0: none, the quiet-machine "
                             "profile as measured)")
    parser.add_argument("--warmup-duration", type=float, default=30.0,
                        help="seconds of a first run at the first rate, served and simulated but neither "
                             "calibrated on nor validated (a freshly deployed app serves its first minute slower; "
                             "0: none)")
    parser.add_argument("--cpu-per-token-ms", type=float, default=DEFAULT_CPU_PER_TOKEN_S * 1000,
                        help="CPU the HTTP proxy, the ingress and the client spend on each streamed token, on the "
                             "cores the engines compute on (sim.host; 0: none)")
    parser.add_argument("--reuse", action="store_true", help="compare the runs already under OUT/real")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args, sweep_extra = parser.parse_known_args(argv)
    rates = [float(rate) for rate in args.rates.split(",") if rate.strip()]
    calibration_rates = [rate for rate in (float(text) for text in args.calibration_rate.split(",") if text.strip())
                         if rate]
    for rate in calibration_rates:
        if rate in rates:
            parser.error(f"--calibration-rate {rate:g} is also in --rates: a run calibrated on is not validated")
    out = Path(args.out or f"sim-validate-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs = [Path(path).resolve() for path in args.configs or DEFAULT_CONFIGS]
    model = args.model or (None if args.configs else DEFAULT_MODEL)
    if model:
        configs = with_model(configs, model, out / "configs")

    import yaml

    from pd.config.app import AppArgs
    from sim.deployment import pool_decode_threads, pool_threads

    apps = [AppArgs.parse(yaml.safe_load(path.read_text())["applications"][0]["args"]) for path in configs]
    threads = sorted({count for app in apps for pool in (app.decode, app.prefill)
                      for count in (pool_threads(pool, app.engine_config()),
                                    pool_decode_threads(pool, app.engine_config()))})
    models = {app.engine.model for app in apps}
    if len(models) != 1:
        raise SystemExit(f"the configs serve different models: {sorted(models)}; --model M serves M in all")
    costs = {}
    for count in threads:  # before any load runs: the profile owns the machine
        path = out / f"profile-{count}-threads.json"
        reused = args.reuse and path.exists()
        costs[count] = CostModel.load(path) if reused else profile(apps[0].engine.model, count, path)
    if not args.reuse:
        run_sweep(configs, calibration_rates + rates, args.duration, args.warmup_duration,
                  args.workload, out / "real", sweep_extra)
    results = validate(configs, rates, calibration_rates, out, costs, args.call_ms / 1000,
                       args.cpu_per_token_ms / 1000)
    summary = {"summary": True, "median_abs_error": median_abs_errors(results)}
    if calibration_rates:
        summary["uncalibrated_median_abs_error"] = median_abs_errors(results, "uncalibrated_error")
    (out / "validate.json").write_text(json.dumps({"workload": args.workload, "results": results, **summary}, indent=1))
    write_plot(results, out / "sim-vs-real.png")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
