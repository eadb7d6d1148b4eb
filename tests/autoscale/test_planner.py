import math
import subprocess
import sys

import pytest

from autoscale.planner import Bounds, Capacity, PlannerConfig, PlannerState, ReplicaSignals, Slo, plan, prefill_ttft_s

# One prefill replica computes 10k prompt tokens/s; a decode step is 10 ms + 1 ms per sequence,
# so 40 sequences fit the 50 ms ITL target.
CAPACITY = Capacity(prefill_tokens_per_s=10_000, decode_step_s=0.01, decode_step_per_seq_s=0.001)
SLO = Slo(ttft_s=1.0, itl_s=0.05)


def config(**overrides) -> PlannerConfig:
    fields = dict(slo=SLO, capacity=CAPACITY, prefill=Bounds(1, 10), decode=Bounds(1, 10), period_s=10.0,
                  scale_down_delay_s=30.0, smoothing=1.0, correction_smoothing=1.0, forecast_periods=0.0,
                  decode_utilization=1.0, hysteresis=0.0)
    return PlannerConfig(**{**fields, **overrides})


def prefill(tokens_per_s: float, prompt_tokens: int = 5000, queued: int = 0, ttft_p90_s: float | None = None,
            period_s: float = 10.0) -> ReplicaSignals:
    tokens = round(tokens_per_s * period_s)
    return ReplicaSignals(prefill_tokens=tokens, queued_prefill_tokens=queued, num_requests=tokens // prompt_tokens,
                          ttft_p90_s=ttft_p90_s)


def decode(seqs: int, itl_p90_s: float | None = None, kv_used: int = 0, kv_total: int = 0,
           waiting: int = 0) -> ReplicaSignals:
    return ReplicaSignals(running_seqs=seqs, waiting_seqs=waiting, itl_p90_s=itl_p90_s, kv_blocks_used=kv_used,
                          kv_blocks_total=kv_total)


def test_prefill_sized_exactly_at_the_slo():
    # 5,000-token prompts take 0.5 s alone; at 50% busy the queue doubles that to exactly the 1 s target.
    assert prefill_ttft_s(2, 10_000, 5000, 10_000) == 1.0
    at_slo, _ = plan(config(), PlannerState(), [prefill(5_000), prefill(5_000)], [decode(1)], 2, 1, now_s=10)
    assert at_slo.num_prefill == 2
    over, _ = plan(config(), PlannerState(), [prefill(5_001), prefill(5_000)], [decode(1)], 2, 1, now_s=10)
    assert over.num_prefill == 3


def test_decode_sized_exactly_at_the_itl_target():
    assert CAPACITY.decode_seqs(SLO.itl_s) == pytest.approx(40)
    at_target, _ = plan(config(), PlannerState(), [prefill(0)], [decode(40), decode(40)], 1, 2, now_s=10)
    assert at_target.num_decode == 2
    over, _ = plan(config(), PlannerState(), [prefill(0)], [decode(41), decode(40)], 1, 2, now_s=10)
    assert over.num_decode == 3


def test_no_traffic_at_all_keeps_the_minimum():
    quiet, state = plan(config(prefill=Bounds(2, 10)), PlannerState(), [ReplicaSignals()] * 2, [ReplicaSignals()],
                        2, 1, now_s=10)
    assert (quiet.num_prefill, quiet.num_decode) == (2, 1)
    # No replica reported at all: nothing to scale on, and nothing breaks.
    nothing, _ = plan(config(), state, [], [], 2, 1, now_s=20)
    assert (nothing.num_prefill, nothing.num_decode) == (2, 1)
    assert math.isfinite(nothing.why["prefill_correction"])


def test_a_metric_missing_from_one_replica_uses_the_others():
    # One replica saw no first token this period (None); the other's TTFT p90 is twice the model's.
    first, state = plan(config(), PlannerState(), [prefill(2_500, ttft_p90_s=None), prefill(2_500, ttft_p90_s=1.2)],
                        [decode(10, itl_p90_s=None), decode(10)], 2, 2, now_s=10)
    # Predicted mean at 25% busy: 0.5 / 0.75 s; observed 1.2 s: the correction is their ratio.
    assert state.prefill_correction == pytest.approx(1.2 / (0.5 / 0.75))
    assert state.decode_correction == 1.0  # no ITL reported by anyone: unchanged
    # The corrected model wants five: 1.8 * 0.5 / (1 - 5000 / (n * 10000)) <= 1 s first at n = 5.
    assert first.num_prefill == 5


def test_min_equal_to_max_never_moves():
    pinned = config(prefill=Bounds(3, 3), decode=Bounds(2, 2))
    busy, state = plan(pinned, PlannerState(), [prefill(100_000)], [decode(500)], 3, 2, now_s=10)
    idle, _ = plan(pinned, state, [ReplicaSignals()], [ReplicaSignals()], 3, 2, now_s=20)
    assert (busy.num_prefill, busy.num_decode) == (idle.num_prefill, idle.num_decode) == (3, 2)


def test_scale_up_in_one_period_scale_down_after_the_delay():
    cfg = config(scale_down_delay_s=30.0)
    up, state = plan(cfg, PlannerState(), [prefill(30_000)], [decode(100)], 1, 1, now_s=10)
    assert (up.num_prefill, up.num_decode) == (6, 3)
    counts = []
    for now_s in (20, 30, 40, 50):  # load gone: the pools wait out 30 s of plans wanting fewer
        down, state = plan(cfg, state, [prefill(0)] * 6, [decode(0)] * 3, 6, 3, now_s=now_s)
        counts.append((down.num_prefill, down.num_decode))
    assert counts == [(6, 3), (6, 3), (6, 3), (1, 1)]


def test_scale_down_goes_to_the_most_wanted_during_the_delay():
    cfg = config(scale_down_delay_s=20.0)
    state = PlannerState()
    wanted = []
    for now_s, seqs in ((10, 200), (20, 100), (30, 60), (40, 20)):
        result, state = plan(cfg, state, [prefill(0)], [decode(seqs)], 1, 5, now_s=now_s)
        wanted.append(result.num_decode)
    # 100 sequences want 3, then 60 want 2: at 40 s the 20 s window held 3, 2 and 1.
    assert wanted == [5, 5, 5, 3]


def test_hysteresis_keeps_a_fleet_that_would_be_just_enough_one_smaller():
    loaded = [decode(39), decode(39), decode(0)]  # 78 sequences: two replicas would do, just
    without, _ = plan(config(scale_down_delay_s=0.0), PlannerState(), [prefill(0)], loaded, 1, 3, now_s=10)
    assert without.num_decode == 2
    with_spare, _ = plan(config(scale_down_delay_s=0.0, hysteresis=0.2), PlannerState(), [prefill(0)], loaded, 1, 3,
                         now_s=10)
    assert with_spare.num_decode == 3


def test_a_queued_backlog_needs_capacity_too():
    steady, _ = plan(config(), PlannerState(queued_prefill_tokens=0), [prefill(5_000)], [decode(1)], 1, 1, now_s=10)
    backlog, _ = plan(config(), PlannerState(queued_prefill_tokens=200_000), [prefill(5_000, queued=200_000)],
                      [decode(1)], 1, 1, now_s=10)
    assert steady.num_prefill == 1  # 5,000 tokens/s of 5,000-token prompts: exactly the 1 s target on one
    assert backlog.num_prefill == 5  # plus 200,000 queued tokens to drain in 10 s: 25,000 tokens/s


def test_decode_is_bounded_by_kv_as_well_as_itl():
    # Each running sequence holds 100 of a replica's 1,000 blocks: 10 fit, though 40 would meet the ITL target.
    result, _ = plan(config(), PlannerState(), [prefill(0)], [decode(10, kv_used=1000, kv_total=1000)], 1, 1, now_s=10)
    assert result.num_decode == 1
    result, _ = plan(config(), PlannerState(), [prefill(0)], [decode(10, kv_used=1000, kv_total=1000, waiting=20)],
                     1, 1, now_s=10)
    assert result.num_decode == 3


def test_a_rising_trend_is_planned_ahead():
    cfg = config(forecast_periods=2.0, smoothing=1.0)
    _, state = plan(cfg, PlannerState(), [prefill(0)], [decode(40)], 1, 1, now_s=10)
    ahead, _ = plan(cfg, state, [prefill(0)], [decode(80)], 1, 2, now_s=20)
    assert ahead.num_decode == 4  # 80 now and rising 40 a period: 160 two periods on


def test_correction_learns_only_while_the_pool_keeps_up():
    backlog = 10 * CAPACITY.prefill_tokens_per_s * SLO.ttft_s  # ten times what the SLO lets wait
    _, state = plan(config(), PlannerState(queued_prefill_tokens=backlog),
                    [prefill(5_000, queued=round(backlog), ttft_p90_s=30.0)], [decode(1)], 1, 1, now_s=10)
    assert state.prefill_correction == 1.0


@pytest.mark.parametrize("fields", [dict(min_replicas=0), dict(min_replicas=3, max_replicas=2)])
def test_bounds_reject_invalid_values(fields):
    with pytest.raises(ValueError, match="replicas"):
        Bounds(**fields)


@pytest.mark.parametrize("overrides", [dict(period_s=0), dict(hysteresis=1.0), dict(decode_utilization=0),
                                       dict(scale_down_delay_s=-1), dict(backlog_drain_s=0)])
def test_config_rejects_invalid_values(overrides):
    with pytest.raises(ValueError):
        config(**overrides)


def test_slo_and_capacity_reject_non_positive_values():
    with pytest.raises(ValueError, match="SLO"):
        Slo(ttft_s=0, itl_s=0.05)
    with pytest.raises(ValueError, match="capacities"):
        Capacity(prefill_tokens_per_s=0, decode_step_s=0.01, decode_step_per_seq_s=0.001)


@pytest.mark.integration  # a child Python checks a fresh import
def test_planner_does_not_import_ray():
    code = "import sys, autoscale.planner; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_an_slo_no_count_can_meet_sizes_for_half_busy_not_for_the_maximum():
    # 20,000-token prompts take 2 s alone: no count meets the 1 s target, as no count shortens a
    # prompt's own compute. A busy pool keeps each replica half busy; an idle one stays at its minimum.
    busy, state = plan(config(), PlannerState(), [prefill(10_000, prompt_tokens=20_000)], [decode(1)], 1, 1,
                       now_s=10)
    assert busy.num_prefill == 2
    assert busy.why["prefill_slo_met"] is False
    idle, _ = plan(config(), state, [prefill(0)], [decode(1)], 1, 1, now_s=20)
    assert idle.why["prompt_tokens"] == 20_000
    assert idle.num_prefill == 1
