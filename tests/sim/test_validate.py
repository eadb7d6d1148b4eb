"""Which of a sweep's runs ``sim.validate`` replays, calibrates on and validates."""

from __future__ import annotations

import pytest

from loadtest.records import META_SUFFIX, REQUESTS_SUFFIX, RequestLog, RunMeta
from loadtest.sweep import WARMUP_PREFIX
from sim.validate import main, served_runs


def _served(directory, name: str, rate: float, start_time: float) -> None:
    RequestLog(directory / (name + REQUESTS_SUFFIX)).close()
    RunMeta(label="pd", workload="mixed", workload_args="", seed=0, model="m", host="h", stream=True,
            arrival_rate=rate, arrival_process="poisson", num_users=1, slo_ttft_ms=1.0, slo_tpot_ms=1.0,
            start_time=start_time, end_time=start_time + 1).write(directory / (name + META_SUFFIX))


def test_the_warm_up_and_the_calibration_run_are_replayed_first_and_not_validated(tmp_path):
    # As a sweep serves them: warm-up, calibration, then the validated rates, not in the order asked for.
    _served(tmp_path, f"{WARMUP_PREFIX}0.75", 0.75, 100.0)
    _served(tmp_path, "rate-0.75", 0.75, 200.0)
    _served(tmp_path, "rate-0.5", 0.5, 300.0)
    _served(tmp_path, "rate-2", 2.0, 400.0)

    runs, calibration, validated = served_runs(tmp_path, [2.0, 0.5], 0.75)

    assert [run.prefix.name for run in runs] == [f"{WARMUP_PREFIX}0.75", "rate-0.75", "rate-0.5", "rate-2"]
    assert calibration.prefix.name == "rate-0.75"
    assert [run.prefix.name for run in validated] == ["rate-2", "rate-0.5"]


def test_without_a_calibration_rate_the_warm_up_is_still_replayed(tmp_path):
    _served(tmp_path, f"{WARMUP_PREFIX}1", 1.0, 100.0)
    _served(tmp_path, "rate-1", 1.0, 200.0)

    runs, calibration, validated = served_runs(tmp_path, [1.0], None)

    assert [run.prefix.name for run in runs] == [f"{WARMUP_PREFIX}1", "rate-1"]
    assert calibration is None and [run.prefix.name for run in validated] == ["rate-1"]


def test_a_calibration_rate_among_the_validated_rates_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--rates", "0.5,0.75", "--calibration-rate", "0.75", "--out", str(tmp_path)])
    assert "--calibration-rate 0.75 is also in --rates" in capsys.readouterr().err
