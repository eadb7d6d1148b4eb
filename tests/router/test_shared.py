"""What a pool's routers share with their caller (pure, no Serve)."""

from __future__ import annotations

import pytest

from router.prefix_index import PrefixIndex
from router.protocol import RoutingStats
from router.shared import MAX_REMEMBERED, PoolRouting, RoutingScopes

A, B, C = b"a" * 8, b"b" * 8, b"c" * 8


def test_a_scope_is_one_object_per_name():
    scopes = RoutingScopes()
    assert scopes.open("decode") is scopes.open("decode")
    assert scopes.open("decode") is not scopes.open("prefill")
    assert RoutingScopes().open("decode") is not scopes.open("decode")


def test_every_token_is_uncached_until_a_router_shares_its_index():
    pool = RoutingScopes().open("decode")
    assert pool.estimate_uncached_tokens([A, B], 40) == 40
    index = PrefixIndex(100)
    index.insert("r1", [A, B])
    index.insert("r2", [A])
    pool.share_index(index, block_size=16)
    assert pool.estimate_uncached_tokens([A, B, C], 40) == 8  # r1 holds 2 blocks of 16
    assert pool.estimate_uncached_tokens([A, B], 32) == 1  # the last token is always computed
    assert pool.estimate_uncached_tokens([], 40) == 40


def test_routed_replicas_are_remembered_within_a_bound():
    pool = RoutingScopes().open("prefill")
    pool.note_routed("req-0", "r1")
    pool.note_routed("req-0", "r2")  # a retry went elsewhere
    assert pool.routed_replica("req-0") == "r2"
    for i in range(1, MAX_REMEMBERED + 1):
        pool.note_routed(f"req-{i}", "r1")
    assert pool.routed_replica("req-0") is None and pool.routed_replica(f"req-{MAX_REMEMBERED}") == "r1"
    assert pool.routed_replica("unknown") is None


def test_a_decode_replicas_step_is_predicted_from_its_reported_decodes():
    from router.latency import LatencyPolicyConfig, LatencyPredictor
    from router.step_cost import StepShape, linear_seconds
    from tests.router.test_latency import COST, Replica

    pool = PoolRouting()
    stats = RoutingStats(num_decoding=12, num_decode_context_tokens=6000)
    assert pool.decode_step_s("d0", stats) is None  # no predictor shared yet
    predictor = LatencyPredictor(LatencyPolicyConfig(block_size=16, min_steps=16, min_replica_steps=4))
    pool.share_predictor(predictor)
    replica = Replica("d0", 0)
    replica.run(50, speed=2.0)  # a replica twice as slow as the pool's law
    predictor.observe("d0", replica.report(), 0.0)
    expected = 2.0 * linear_seconds(COST, StepShape(12, 6012, 12, 12).vector())
    assert pool.decode_step_s("d0", stats) == pytest.approx(expected, rel=1e-2)
    assert pool.decode_step_s("d0", RoutingStats()) is None  # nothing decoding: no step to predict
