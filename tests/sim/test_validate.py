"""``sim.validate``, ``sim.replay`` and ``sim.calibration``: which of a sweep's runs are replayed, calibrated on and
validated, how a replay delivers tokens, and what a calibration fits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from loadtest.sweep import WARMUP_PREFIX
from pd.workload.records import META_SUFFIX, REQUESTS_SUFFIX, RequestLog, RequestRecord, RunMeta, Status
from pd.workload.workloads import make_workload, parse_workload_args
from sim.calibration import Calibration, ItlLine, calibrate, calibrated_spec, itl_by_streams
from sim.cost import CostModel
from sim.replay import Run, _as_loadtest_record, simulate_runs
from sim.replica import RequestRecord as SimRecord
from sim.validate import main, served_runs

REPO = Path(__file__).resolve().parents[2]


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

    runs, calibration, validated = served_runs(tmp_path, [2.0, 0.5], [0.75])

    assert [run.prefix.name for run in runs] == [f"{WARMUP_PREFIX}0.75", "rate-0.75", "rate-0.5", "rate-2"]
    assert [run.prefix.name for run in calibration] == ["rate-0.75"]
    assert [run.prefix.name for run in validated] == ["rate-2", "rate-0.5"]


def test_two_calibration_rates_and_any_other_rate_served_are_replayed_and_not_validated(tmp_path):
    _served(tmp_path, f"{WARMUP_PREFIX}0.75", 0.75, 100.0)
    _served(tmp_path, "rate-0.75", 0.75, 200.0)
    _served(tmp_path, "rate-1.5", 1.5, 300.0)
    _served(tmp_path, "rate-1", 1.0, 400.0)
    _served(tmp_path, "rate-3", 3.0, 500.0)  # served, and left out of this comparison: still replayed

    runs, calibration, validated = served_runs(tmp_path, [1.0], [0.75, 1.5])

    assert [run.prefix.name for run in runs] == [f"{WARMUP_PREFIX}0.75", "rate-0.75", "rate-1.5", "rate-1", "rate-3"]
    assert [run.prefix.name for run in calibration] == ["rate-0.75", "rate-1.5"]
    assert [run.prefix.name for run in validated] == ["rate-1"]


def test_without_a_calibration_rate_the_warm_up_is_still_replayed(tmp_path):
    _served(tmp_path, f"{WARMUP_PREFIX}1", 1.0, 100.0)
    _served(tmp_path, "rate-1", 1.0, 200.0)

    runs, calibration, validated = served_runs(tmp_path, [1.0])

    assert [run.prefix.name for run in runs] == [f"{WARMUP_PREFIX}1", "rate-1"]
    assert calibration == [] and [run.prefix.name for run in validated] == ["rate-1"]


def test_a_calibration_rate_among_the_validated_rates_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--rates", "0.5,0.75", "--calibration-rate", "0.75", "--out", str(tmp_path)])
    assert "--calibration-rate 0.75 is also in --rates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--rates", "0.5,1.5", "--calibration-rate", "0.75,1.5", "--out", str(tmp_path)])
    assert "--calibration-rate 1.5 is also in --rates" in capsys.readouterr().err


def _streamed(index: int, start_time: float, ttft_ms: float, gaps_ms: list[float]) -> RequestRecord:
    e2e_ms = ttft_ms + sum(gaps_ms)
    return RequestRecord(index=index, kind="k", endpoint="/v1/completions", start_time=start_time, status=Status.OK,
                         ttft_ms=ttft_ms, tpot_ms=(e2e_ms - ttft_ms) / len(gaps_ms), e2e_ms=e2e_ms, prompt_tokens=8,
                         max_tokens=len(gaps_ms) + 1, output_tokens=len(gaps_ms) + 1, num_chunks=len(gaps_ms) + 1,
                         itl_ms=tuple(gaps_ms))


def test_the_gaps_between_tokens_are_counted_by_the_streams_decoding_when_they_end():
    # One stream alone at 4 ms a token, joined for 0.2 s by a second one at 8 ms each, then alone again.
    alone = _streamed(0, 0.0, 10.0, [4.0] * 50 + [8.0] * 25 + [4.0] * 60)
    joined = _streamed(1, 0.2, 10.0, [8.0] * 25)

    by_streams = itl_by_streams([alone, joined])

    assert by_streams == {1: 4.0, 2: 8.0}
    line = ItlLine.of([alone, joined])
    assert line.first == 1 and line.intercept_ms == pytest.approx(0.0, abs=1e-9)
    assert line.slope_ms == pytest.approx(4.0) and line.at(3) == pytest.approx(12.0)


def test_delivery_delays_keep_the_tokens_in_order():
    real = _streamed(0, 100.0, 0.0, [10.0, 10.0])
    sim = SimRecord(arrival_s=1.0, num_prompt_tokens=8, token_times_s=[1.05, 1.06, 1.07], finished_s=1.07)

    # the first token is held up past the next two: all three reach the client together
    record = _as_loadtest_record(real, sim, end_s=10.0, arrival_s=1.0, delivery_s=[0.03, 0.0, 0.0])

    assert record.status == Status.OK and record.ttft_ms == pytest.approx(80.0)
    assert record.itl_ms == pytest.approx((0.0, 0.0)) and record.e2e_ms == pytest.approx(80.0)
    # a last token delivered after the run's end is cut off with it
    late = _as_loadtest_record(real, sim, end_s=1.08, arrival_s=1.0, delivery_s=[0.0, 0.0, 0.02])
    assert late.status == Status.CUTOFF and late.output_tokens == 2


def test_a_step_overhead_must_not_be_negative():
    cost = CostModel(1e-3, 1e-4, 0.0, 1e-4, 0.0, source="test")
    assert cost.with_overhead(2e-3, 1e-3, "why").base_s == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="step_s=-0.001"):
        cost.with_overhead(-1e-3, 0.0, "why")


def _spec_for(calibration):
    args = yaml.safe_load((REPO / "serve_configs" / "colocated.yaml").read_text())["applications"][0]["args"]
    cost = CostModel(base_s=6e-4, per_token_s=1.6e-4, per_pair_s=1.9e-7, per_seq_s=3.7e-4, per_sample_s=0.0,
                     source="test")
    return calibrated_spec(args, lambda threads: cost, calibration, call_s=0.002)


def _sent(rate: float, start_time: float, count: int) -> tuple[RunMeta, list[RequestRecord]]:
    """``count`` requests of a small ``mixed`` workload, sent at ``rate`` requests/s: a run to simulate."""
    meta = RunMeta(label="pd", workload="mixed", seed=7, model="builtin:tiny-llama", host="h", stream=True,
                   workload_args="long_short.prompt_len=384,short_long.output_len=48,chat.output_len=24",
                   arrival_rate=rate, arrival_process="poisson", num_users=1, slo_ttft_ms=2000.0, slo_tpot_ms=100.0,
                   start_time=start_time, end_time=start_time + 60.0)
    workload = make_workload(meta.workload, meta.seed, parse_workload_args(meta.workload_args))
    draw, sent_at, sent = random.Random(0), meta.start_time, []
    for index in range(count):
        sent_at += draw.expovariate(meta.arrival_rate)
        request = workload.request(index)
        sent.append(RequestRecord(
            index=index, kind=request.kind, endpoint="/v1/chat/completions" if request.is_chat else "/v1/completions",
            start_time=sent_at, status=Status.OK, ttft_ms=float("nan"), tpot_ms=float("nan"), e2e_ms=float("nan"),
            prompt_tokens=0, max_tokens=request.max_tokens, output_tokens=0, num_chunks=0, itl_ms=()))
    return meta, sent


@pytest.mark.slow  # a simulated run, then the calibration's search over its runs: 4-5 s on 2 cores
def test_a_calibration_recovers_the_overheads_that_made_a_run():
    """A run simulated with known overheads, ingress time and delivery jitter, calibrated on: the same come back."""
    meta, sent = _sent(rate=2.0, start_time=1000.0, count=100)
    truth = Calibration(step_s=3e-3, token_s=1e-3, ingress_s=0.02, cpu_per_token_s=4e-3, jitter_s=2e-3)
    measured = simulate_runs([Run(Path("sent"), sent, meta)], _spec_for(truth), truth.jitter_s)[0][0]
    assert ItlLine.of(measured).slope_ms is not None  # the run had steps of one and of two streams

    # the rest of the path's CPU per token is given (a run at this load cannot tell it from the jitter)
    fitted = calibrate([Run(Path("measured"), measured, meta)], _spec_for, cpu_per_token_s=truth.cpu_per_token_s)

    for name in ("step_s", "token_s", "ingress_s", "jitter_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), (name, fitted)


@pytest.mark.slow  # a simulated run per calibration: 4 s
def test_the_gaps_line_is_fitted_over_every_calibration_run():
    """A light run, one stream at a time, shows no growth with streams; a heavier one after it does: the per-token
    overhead comes from both together."""
    truth = Calibration(step_s=3e-3, token_s=1e-3, ingress_s=0.02, cpu_per_token_s=4e-3, jitter_s=2e-3)
    light_meta, light_sent = _sent(rate=0.2, start_time=1000.0, count=25)
    heavy_meta, heavy_sent = _sent(rate=2.0, start_time=2000.0, count=100)
    light, heavy = simulate_runs([Run(Path("light"), light_sent, light_meta),
                                  Run(Path("heavy"), heavy_sent, heavy_meta)], _spec_for(truth), truth.jitter_s)[0]
    light_run, heavy_run = Run(Path("light"), light, light_meta), Run(Path("heavy"), heavy, heavy_meta)
    assert ItlLine.of(light).slope_ms is None and ItlLine.of(heavy).slope_ms is not None

    alone = calibrate([light_run], _spec_for, cpu_per_token_s=truth.cpu_per_token_s)
    both = calibrate([light_run, heavy_run], _spec_for, cpu_per_token_s=truth.cpu_per_token_s)

    assert alone.token_s == 0.0  # one stream at a time: nothing to tell a step's overhead from a token's
    assert both.token_s == pytest.approx(truth.token_s, rel=0.1) and both.step_s == pytest.approx(truth.step_s, rel=0.1)
