"""The planner's Serve side without a cluster: replica reports, measured capacity, and the policy Serve calls."""

from __future__ import annotations

import math

import pytest

from autoscale.capacity import MIN_SECONDS, StepSums, decode_step_line, prefill_tokens_per_s
from autoscale.planner import Bounds
from autoscale.serve import LatencyWindow, PlannerPolicy, replica_metrics, replica_reports
from pd.engine.step_times import StepTimes


def sums_of(times: StepTimes, computed_tokens: int = 0) -> StepSums:
    return StepSums(num_computed_prompt_tokens=computed_tokens, **vars(times))


def test_prefill_capacity_is_tokens_over_the_seconds_that_computed_them():
    times = StepTimes()
    for _ in range(10):
        times.record(0.2, num_prompt_tokens=1000, num_seqs=2)
    times.record(5.0, num_prompt_tokens=0, num_seqs=4)  # a decode step: not prefill time
    assert prefill_tokens_per_s(sums_of(times, 10_000)) == pytest.approx(5000)
    assert prefill_tokens_per_s(StepSums(num_computed_prompt_tokens=100, prefill_seconds=MIN_SECONDS / 2)) is None


def test_decode_line_is_fitted_from_steps_of_different_batches():
    times = StepTimes()
    for batch in (1, 2, 4, 8, 16, 32) * 20:
        times.record(0.01 + 0.002 * batch, num_prompt_tokens=0, num_seqs=batch)
    step_s, per_seq_s = decode_step_line(sums_of(times))
    assert step_s == pytest.approx(0.01) and per_seq_s == pytest.approx(0.002)


def test_decode_line_at_one_batch_size_charges_the_whole_step_per_sequence():
    times = StepTimes()
    for _ in range(100):
        times.record(0.02, num_prompt_tokens=0, num_seqs=4)
    assert decode_step_line(sums_of(times)) == pytest.approx((0.0, 0.005))
    assert decode_step_line(StepSums()) is None


def test_latency_window_keeps_only_its_period():
    now = [0.0]
    window = LatencyWindow(10.0, clock=lambda: now[0])
    for i in range(100):
        now[0] = i / 10
        window.observe(1.0 if i < 50 else 0.1)  # the slow half is older than 10 s at t=14.95
    assert window.p90() == pytest.approx(1.0)
    now[0] = 14.95
    assert window.p90() == pytest.approx(0.1)
    now[0] = 100.0
    assert window.p90() is None


class _Stats:
    """The ``EngineStats`` fields a replica reports."""

    def __init__(self, **values) -> None:
        base = dict(num_computed_prompt_tokens=0, prefill_seconds=0.0, decode_steps=0, decode_seconds=0.0,
                    decode_seqs=0, decode_seqs_sq=0, decode_seq_seconds=0.0, num_waiting_tokens=0, num_running=0,
                    num_waiting=0, num_used_blocks=0, num_free_blocks=100)
        self.__dict__.update({**base, **values})


def test_replica_metrics_leave_out_a_latency_with_no_sample():
    window = LatencyWindow(10.0)
    report = replica_metrics(_Stats(num_running=3), 7, ttft=window, itl=None)
    assert "ttft_p90_s" not in report and "itl_p90_s" not in report
    assert report["num_running"] == 3 and report["num_prefilled"] == 7 and report["num_total_blocks"] == 100
    assert all(isinstance(value, float) for value in report.values())  # Serve takes ints and floats only
    window.observe(0.5)
    assert replica_metrics(_Stats(), 0, ttft=window, itl=None)["ttft_p90_s"] == 0.5


class _Point:
    def __init__(self, timestamp: float, value: float) -> None:
        self.timestamp, self.value = timestamp, value


def raw(now: dict[str, dict[str, float]], at: float, before: dict[str, dict[str, float]] | None = None,
        span_s: float = 2.0) -> dict:
    """Serve's ``raw_metrics`` (metric -> replica -> series): each replica's ``before`` report, then ``now``'s."""
    metrics: dict = {}
    for replica_id, report in now.items():
        earlier = (before or {}).get(replica_id, report)
        for name, value in report.items():
            series = [_Point(at - span_s, earlier.get(name, value)), _Point(at, value)]
            metrics.setdefault(name, {})[replica_id] = series
    return metrics


def prefill_report(computed: float, queued: float = 0, requests: float = 0, ttft: float | None = None,
                   busy_s: float = 10.0) -> dict[str, float]:
    report = replica_metrics(_Stats(num_computed_prompt_tokens=computed, prefill_seconds=busy_s,
                                    num_waiting_tokens=queued), requests, None, None)
    return report | ({"ttft_p90_s": ttft} if ttft is not None else {})


def test_reports_read_counters_as_rates_and_drop_a_latency_older_than_the_report():
    metrics = raw({"a": prefill_report(1000, ttft=0.5)}, at=20.0, before={"a": prefill_report(200)}, span_s=4.0)
    metrics["ttft_p90_s"]["a"] = [_Point(12.0, 0.9)]  # from an earlier window; nothing since
    [(replica_id, report)] = replica_reports(metrics).items()
    assert replica_id == "a" and report.at == 20.0
    assert "ttft_p90_s" not in report.values and report.values["num_running"] == 0.0
    assert report.rates["num_computed_prompt_tokens"] == pytest.approx(200.0)  # 800 tokens over 4 s


def policy(**planner) -> PlannerPolicy:
    fields = dict(period_s=2.0, scale_down_delay_s=4.0, smoothing=1.0, correction_smoothing=1.0,
                  forecast_periods=0.0, hysteresis=0.0)
    return PlannerPolicy("prefill", slo_s=1.0, planner={**fields, **planner}, capacity={})


def test_policy_plans_once_a_period_and_scales_prefill_on_measured_capacity():
    planner, bounds = policy(), Bounds(1, 4)
    # One replica measured at 1,000 tokens/s (10,000 tokens in 10 s of prefill steps), idle for 2 s.
    idle = prefill_report(10_000)
    count, why = planner.decide(replica_reports(raw({"a": idle}, at=100.0)), 1, bounds, now_s=100.0)
    assert count == 1
    # Two seconds later it has computed 3,600 more tokens and 5,000 wait: far more than one replica carries.
    busy = prefill_report(13_600, queued=5000, requests=10, busy_s=13.6)
    reports = replica_reports(raw({"a": busy}, at=102.0, before={"a": idle}))
    assert planner.decide(reports, 1, bounds, now_s=101.0) == (1, {})  # within the period: no plan
    count, why = planner.decide(reports, 1, bounds, now_s=102.0)
    assert count > 1 and why["prefill_tokens_per_s"] > 1000


def test_policy_scales_down_only_once_every_replica_of_the_target_reports():
    planner, bounds = policy(scale_down_delay_s=2.0), Bounds(1, 4)
    idle = prefill_report(10_000)  # 1,000 tokens/s measured, nothing arriving: one replica is plenty
    one = replica_reports(raw({"a": idle}, at=100.0))
    # The target is 2 and the second replica is still starting: its absence is not lower demand.
    for now_s in (100.0, 102.0, 104.0, 106.0):
        assert planner.decide(one, 2, bounds, now_s=now_s)[0] == 2
    both = replica_reports(raw({"a": idle, "b": idle}, at=108.0))
    assert planner.decide(both, 2, bounds, now_s=108.0)[0] == 2  # the delay starts now
    assert planner.decide(both, 2, bounds, now_s=110.0)[0] == 1


def test_policy_without_a_measured_or_configured_capacity_keeps_the_target():
    planner = policy()
    reports = replica_reports(raw({"a": prefill_report(10, busy_s=0.01)}, at=5.0))
    assert planner.decide(reports, 3, Bounds(1, 4), now_s=5.0)[0] == 3
    assert planner.decide({}, 2, Bounds(1, 4), now_s=10.0)[0] == 2  # no replica reported at all


def test_policy_with_min_equal_to_max_never_moves():
    planner = policy()
    reports = replica_reports(raw({"a": prefill_report(10_000, queued=10**6)}, at=5.0))
    assert planner.decide(reports, 2, Bounds(2, 2), now_s=5.0)[0] == 2


def test_policy_kwargs_are_checked_when_serve_builds_it():
    with pytest.raises(ValueError, match="pool"):
        PlannerPolicy("middle", slo_s=1.0)
    with pytest.raises(ValueError, match="hysteresis"):
        PlannerPolicy("decode", slo_s=0.1, planner={"hysteresis": 1.5})


def test_policy_through_serves_own_wrapper_and_context():
    """Serve wraps a custom policy with its bounds and delays; with the app's zero delays the plan passes through."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from pd.config.app import AppArgs

    args = AppArgs.parse({"prefill": {"autoscaling": {"min_replicas": 1, "max_replicas": 3, "slo_ttft_s": 1.0,
                                                      "period_s": 2.0, "forecast_periods": 0}}})
    serve_config = AutoscalingConfig(**args.deployment_options("prefill")["autoscaling_config"])
    planner = PlannerPolicy(**serve_config.policy.policy_kwargs)
    wrapped = _apply_autoscaling_config(planner)
    deployment = DeploymentID(name="PrefillServer", app_name="pd")
    replica = ReplicaID(unique_id="a", deployment_id=deployment)

    def context(at: float, report: dict, target: int, before: dict | None = None) -> AutoscalingContext:
        series_of = raw({"a": report}, at, {"a": before or report})
        metrics = {name: {replica: series["a"]} for name, series in series_of.items()}
        return AutoscalingContext(
            deployment_id=deployment, deployment_name="PrefillServer", app_name="pd", current_num_replicas=target,
            target_num_replicas=target, running_replicas=[replica], total_num_requests=0.0,
            total_queued_requests=0.0, aggregated_metrics={}, raw_metrics=metrics, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=3, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
            current_time=at, config=serve_config)

    idle = prefill_report(10_000)
    assert wrapped(context(100.0, idle, 1))[0] == 1
    count, _ = wrapped(context(102.0, prefill_report(20_000, queued=20_000, requests=10, busy_s=20.0), 1, idle))
    assert count == 3  # more than one replica's worth: straight up, capped by max_replicas
    assert math.isfinite(planner.state.prefill_correction)
