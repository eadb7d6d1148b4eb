"""A short version of ``python -m sim.validate`` in CI: the default app served for real, then simulated.

One config (the default app of the shared test cluster), one validated rate.
The profile is measured here, on a small grid; after a warm-up run, a run at
a lower rate calibrates what the profile does not see
(``sim.calibration.calibrate``, with the warm-up replayed before it), a third
is validated, and all are replayed in order on one simulated deployment. Tolerance: each of TTFT p50, E2E p50 and goodput within 50% of
the measured value, loose because this machine also runs the test cluster's
second node and pytest itself; ``sim.validate`` reports the real figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.serve import conftest

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.5


def _locust(url: str, prefix: Path, rate: float, seconds: int) -> None:
    command = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"), "--headless",
               "--host", url, "--csv", str(prefix), "--only-summary", "-u", "1", "-r", "1",
               "--run-time", f"{seconds}s", "--arrival-rate", str(rate), "--workload", "mixed",
               "--workload-args", "long_short.prompt_len=384,short_long.output_len=48,chat.output_len=24",
               "--seed", "7"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=seconds + 90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_simulator_predicts_a_real_run_of_the_default_app(default_app, tmp_path):
    import dataclasses

    from sim.cost import CostModel
    from sim.profile import measure
    from sim.calibration import calibrate, calibrated_spec
    from sim.replay import Run
    from sim.validate import compare

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
    result = compare(runs, spec_for(calibration))[2]
    print(json.dumps({"calibration": dataclasses.asdict(calibration), **result}))
    assert result["requests"] >= 10 and result["prompt_length_mismatches"] == 0
    for metric in ("ttft_p50", "e2e_p50", "goodput"):
        assert abs(result["error"][metric]) <= TOLERANCE, (metric, result)
