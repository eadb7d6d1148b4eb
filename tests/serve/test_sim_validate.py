"""A short version of ``python -m sim.validate`` in CI: the default app served for real, then simulated.

One config (the default app of the shared test cluster), one validated rate.
The profile is measured here, on a small grid; after a warm-up run, a run at
a lower rate calibrates what the profile does not see
(``sim.calibration.calibrate``, with the warm-up replayed before it), a third
is validated, and all are replayed in order on one simulated deployment.

This machine also runs the test cluster's second node, pytest and, in CI, other
jobs, so a fixed tolerance on measured times (this test once allowed 50%) fails
whenever the load changes between the calibration run and the validated one.
What is asserted instead:

- behaviour: the simulator orders the requests as the app did (the rank
  correlation of per-request E2E latencies), and finishes as many of them;
- scale: each simulated median lies within the measured run's own spread, the
  larger of half the median and the p10-p90 range of the same metric's
  per-request values: a busier machine widens that range, so the tolerance
  widens with the noise that caused it.

``sim.validate`` reports the real relative errors on a quiet machine.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from tests.serve import conftest

REPO = Path(__file__).resolve().parents[2]
# The least rank correlation of simulated with measured E2E per request: the mixed workload's output lengths
# (24 to 48 tokens, and short ones) set most of the order, which a simulator that models decode at all keeps.
MIN_E2E_RANK_CORRELATION = 0.5
# The relative half-width allowed to a simulated median when the measured spread is narrower than that.
MIN_RELATIVE_TOLERANCE = 0.5


def _locust(url: str, prefix: Path, rate: float, seconds: int) -> None:
    command = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"), "--headless",
               "--host", url, "--csv", str(prefix), "--only-summary", "-u", "1", "-r", "1",
               "--run-time", f"{seconds}s", "--arrival-rate", str(rate), "--workload", "mixed",
               "--workload-args", "long_short.prompt_len=384,short_long.output_len=48,chat.output_len=24",
               "--seed", "7"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=seconds + 90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (NaN when either side is constant)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / norm if norm else math.nan


def assert_within_measured_spread(name: str, measured: list[float], simulated: list[float]) -> None:
    """The simulated median of a per-request metric lies within the measured values' own spread."""
    measured = [v for v in measured if not math.isnan(v)]
    simulated = [v for v in simulated if not math.isnan(v)]
    deciles = statistics.quantiles(measured, n=10)
    real_p50, sim_p50 = statistics.median(measured), statistics.median(simulated)
    allowed = max(MIN_RELATIVE_TOLERANCE * real_p50, deciles[-1] - deciles[0])
    assert abs(sim_p50 - real_p50) <= allowed, (name, {"measured_p50": real_p50, "simulated_p50": sim_p50,
                                                       "measured_p10": deciles[0], "measured_p90": deciles[-1]})


def test_the_simulator_predicts_a_real_run_of_the_default_app(default_app, tmp_path):
    import dataclasses

    from pd.workload.records import Status
    from sim.calibration import calibrate, calibrated_spec
    from sim.cost import CostModel
    from sim.profile import measure
    from sim.replay import Run, simulate_runs
    from sim.validate import metric_values

    shapes, seconds = measure("builtin:tiny-llama", 1, batch_sizes=(1, 4), prompt_lens=(32, 384), repeats=1)
    cost = CostModel.fit(shapes, seconds, "measured in CI")
    args = conftest.test_args("default.yaml")

    def spec_for(calibration):
        return calibrated_spec(args, lambda threads: cost, calibration, call_s=0.002)

    # A first run warms the app (its first requests pay one-off costs a calibration must not learn); then
    # about 12 requests to calibrate on and 30 to validate: a median of fewer moved by half between runs.
    _locust(default_app.url, tmp_path / "warm-up", 1.0, 10)
    _locust(default_app.url, tmp_path / "calibration", 0.5, 24)
    _locust(default_app.url, tmp_path / "validation", 1.0, 30)
    runs = [Run.read(tmp_path / name) for name in ("warm-up", "calibration", "validation")]
    calibration = calibrate(runs[1:2], spec_for, before=runs[:1])
    simulated, mismatched = simulate_runs(runs, spec_for(calibration))
    real, sim = runs[2].records, simulated[2]
    print(json.dumps({"calibration": dataclasses.asdict(calibration), "requests": len(real),
                      "measured": metric_values(runs[2].summary()),
                      "simulated": metric_values(runs[2].summary(sim))}))
    assert len(real) >= 10 and mismatched == 0

    finished = [(r, s) for r, s in zip(real, sim) if r.status == Status.OK and s.status == Status.OK]
    num_real_ok = sum(r.status == Status.OK for r in real)
    num_sim_ok = sum(s.status == Status.OK for s in sim)
    # Requests still in flight at the run's end may fall either side of the cut-off.
    assert abs(num_sim_ok - num_real_ok) <= max(2, len(real) // 10), (num_real_ok, num_sim_ok)
    rho = rank_correlation([r.e2e_ms for r, _ in finished], [s.e2e_ms for _, s in finished])
    assert rho >= MIN_E2E_RANK_CORRELATION, rho
    for metric in ("ttft_ms", "e2e_ms"):
        assert_within_measured_spread(metric, [getattr(r, metric) for r, _ in finished],
                                      [getattr(s, metric) for _, s in finished])
