"""The ingress's remote-prefill rule."""

import pytest

from router.remote_prefill import RemotePrefillRule


def test_remote_only_for_long_uncached_prompts_while_the_pool_has_room():
    rule = RemotePrefillRule(threshold=256, queue_bound=4)
    assert rule.wants_remote(1000, 1000, 0)
    assert not rule.wants_remote(256, 256, 0)  # at the threshold: local
    assert not rule.wants_remote(1000, 200, 0)  # the decode pool holds most of it
    assert not rule.wants_remote(1000, 1000, 4)  # the prefill pool is saturated


def test_the_bar_rises_with_prefill_calls_in_flight():
    rule = RemotePrefillRule(threshold=256, queue_bound=32, threshold_per_in_flight=100)
    assert rule.wants_remote(600, 600, 3)  # 600 > 256 + 300
    assert not rule.wants_remote(600, 600, 4)  # 600 <= 256 + 400


@pytest.mark.parametrize("field, value", [("threshold", -1), ("queue_bound", 0), ("threshold_per_in_flight", -0.5)])
def test_bad_values_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        RemotePrefillRule(**{field: value})


def test_the_predicted_rule_compares_seconds_counting_the_decodes_a_local_prefill_stalls():
    from router.latency import Prediction

    rule = RemotePrefillRule(predicted=True, stall_weight=1.0)
    remote = Prediction("p0", ttft_s=0.10, compute_s=0.10, num_decoding=0, matched_tokens=0)
    idle = Prediction("d0", ttft_s=0.12, compute_s=0.12, num_decoding=0, matched_tokens=0)
    busy = Prediction("d0", ttft_s=0.12, compute_s=0.12, num_decoding=8, matched_tokens=0)
    assert not rule.prefers_remote(idle, remote, transfer_s=0.03, overhead_s=0.002)  # 0.132 >= 0.12
    assert rule.prefers_remote(busy, remote, transfer_s=0.03, overhead_s=0.002)  # 0.132 < 0.12 + 0.12
    assert not RemotePrefillRule(predicted=True, stall_weight=0.0).prefers_remote(busy, remote, 0.03, 0.002)
    with pytest.raises(ValueError, match="stall_weight"):
        RemotePrefillRule(stall_weight=-1.0)
