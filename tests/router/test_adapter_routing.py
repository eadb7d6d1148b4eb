"""Routing that knows LoRA adapters: a replica holding the request's adapter is preferred, the load bounds
still spread a hot adapter, and a request on the base model is placed exactly as before."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from router.adapters import AdapterFit, SentAdapters, adapter_fit
from router.decode_policy import DecodePolicy, DecodePolicyConfig
from router.hashing import adapter_root_hash, hash_block_tokens
from router.latency import LatencyPolicyConfig, PredictedLatencyPolicy
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad, RoutingReason

BLOCK = 16
COST = (2e-3, 4e-5, 2e-9, 1e-4, 2e-4)  # base, per token, per pair, per seq, per sample


def prompt(num_tokens: int, adapter: str | None = None, first_token: int = 0) -> tuple[list[bytes], int]:
    """(block hashes, token count) of a prompt of ``num_tokens`` distinct tokens, under ``adapter``'s root."""
    tokens = list(range(first_token, first_token + num_tokens))
    if adapter is None:
        return hash_block_tokens(tokens, BLOCK), num_tokens
    return hash_block_tokens(tokens, BLOCK, parent_hash=adapter_root_hash(adapter, "d")), num_tokens


def make_policy(**overrides) -> PrefixAffinityPolicy:
    return PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, **overrides))


def test_the_three_cases_of_an_adapter_on_a_replica():
    assert adapter_fit(None, (), 0) is AdapterFit.HELD  # the base model needs no slot
    assert adapter_fit("x", ("x", "y"), 2) is AdapterFit.HELD
    assert adapter_fit("x", ("y",), 2) is AdapterFit.LOAD
    assert adapter_fit("x", ("y", "z"), 2) is AdapterFit.EVICT
    assert adapter_fit("x", (), 0) is AdapterFit.LOAD  # no report yet: a load, no eviction known


def test_adapters_sent_since_a_report_count_as_held_until_the_next_one():
    sent = SentAdapters()
    sent.sent("a", "x")
    sent.sent("a", None)  # the base model holds no slot
    assert sent.fit("x", "a", (), 2) is AdapterFit.HELD
    assert sent.fit("y", "a", ("z",), 2) is AdapterFit.EVICT  # z reported and x sent fill both slots
    assert sent.fit("x", "b", (), 2) is AdapterFit.LOAD
    sent.reported("a")
    assert sent.fit("x", "a", (), 2) is AdapterFit.LOAD


def test_prefill_prefers_the_replica_holding_the_adapter_at_equal_prefix():
    block_hashes, num_tokens = prompt(64, "x")
    policy = make_policy()
    policy.index.insert("a", block_hashes[:2])
    policy.index.insert("b", block_hashes[:2])
    candidates = [ReplicaLoad("a", adapters=("y", "z"), max_loras=2), ReplicaLoad("b", adapters=("x", "y"),
                                                                                  max_loras=2)]
    for _ in range(20):  # not a tie broken at random
        decision = policy.choose(block_hashes, num_tokens, candidates, adapter="x")
        assert (decision.replica_id, decision.reason, decision.adapter) == ("b", RoutingReason.PREFIX, "x")
    # A free slot costs one copy; a full set of slots the copy, the evicted adapter's copy and the wait.
    config = policy.config
    assert policy.adapter_load(ReplicaLoad("c", adapters=("y",), max_loras=2), "x") == config.adapter_load_tokens
    assert policy.adapter_load(candidates[0], "x") == 2 * config.adapter_load_tokens + config.adapter_wait_tokens
    assert policy.adapter_load(candidates[1], "x") == 0.0


def test_the_adapter_is_priced_as_load_beside_the_prefix():
    block_hashes, num_tokens = prompt(64, "x")
    policy = make_policy(w_prefix=1.0, w_load=1.0, request_load_tokens=0.0, kv_usage_load_tokens=0.0,
                         adapter_load_tokens=10.0, adapter_wait_tokens=20.0, max_routed_ratio=None)
    policy.index.insert("a", block_hashes[:3])  # a: 16 tokens to compute, b: 64
    # a lacks x with its slots full: 16 + 2 * 10 + 20 = 56 < 64: its prefix still wins.
    loads = [ReplicaLoad("a", adapters=("y",), max_loras=1), ReplicaLoad("b", adapters=("x",), max_loras=1)]
    assert policy.choose(block_hashes, num_tokens, loads, adapter="x").replica_id == "a"
    # 9 queued tokens more tip it: 65 > 64.
    loads[0] = dataclasses.replace(loads[0], queued_prefill_tokens=9)
    assert policy.choose(block_hashes, num_tokens, loads, adapter="x").replica_id == "b"


def test_a_spilled_adapter_stays_where_it_was_sent_before_the_report_shows_it():
    policy = make_policy(max_routed_ratio=None, recent_request_load_tokens=0.0, recent_prefill_weight=0.0,
                         unreported_prefill_weight=0.0)
    full = [ReplicaLoad(replica_id, adapters=("y", "z"), max_loras=2) for replica_id in "abc"]
    first = policy.choose(*prompt(40, "x"), full, adapter="x")
    policy.record_routed(first, [])
    # An unrelated prompt of x: every replica reports its slots full, but x went to one since.
    for start in (1000, 2000, 3000):
        assert policy.choose(*prompt(40, "x", start), full, adapter="x").replica_id == first.replica_id
    policy.reported(first.replica_id)  # its report holds y and z still: x is a load there again
    chosen = {policy.choose(*prompt(40, "x", 4000), full, adapter="x").replica_id for _ in range(60)}
    assert chosen == set("abc")


def test_the_load_bound_spreads_a_hot_adapter():
    """Every request runs under x, which only a holds, as every report says: the relative bound alone spreads
    them (no load term, and each replica reports after each request, so none holds x from being sent it)."""

    def route_all(policy: PrefixAffinityPolicy) -> Counter:
        loads = [ReplicaLoad("a", adapters=("x", "y"), max_loras=2)] + [
            ReplicaLoad(replica_id, adapters=("y", "z"), max_loras=2) for replica_id in "bcd"]
        counts = Counter()
        for request in range(400):
            block_hashes, num_tokens = prompt(3 * BLOCK, "x", first_token=10_000 + 100 * request)
            decision = policy.choose(block_hashes, num_tokens, loads, adapter="x")
            policy.record_routed(decision, block_hashes)
            policy.reported(decision.replica_id)
            counts[decision.replica_id] += 1
        return counts

    only_adapter = dict(recent_request_load_tokens=0.0, recent_prefill_weight=0.0, unreported_prefill_weight=0.0)
    assert route_all(make_policy(max_routed_ratio=None, **only_adapter)) == Counter(a=400)
    bounded = route_all(make_policy(**only_adapter))
    assert len(bounded) == 4 and max(bounded.values()) / min(bounded.values()) <= 1.5
    spread = route_all(make_policy())  # the defaults
    assert len(spread) == 4 and max(spread.values()) / min(spread.values()) <= 1.5


def test_decisions_without_an_adapter_are_unchanged():
    """The same stream of base-model prompts, with and without adapters reported: the same decisions."""

    def route(with_adapters: bool) -> list[tuple[str, RoutingReason]]:
        policy, rng, decisions = make_policy(seed=3), random.Random(7), []
        for request in range(200):
            replicas = [ReplicaLoad(r, queued_prefill_tokens=rng.randrange(500), num_active_requests=rng.randrange(4),
                                    adapters=("x", "y") if with_adapters else (), max_loras=2 if with_adapters else 0)
                        for r in "abcd"]
            block_hashes, num_tokens = prompt(rng.randrange(20, 200), first_token=rng.randrange(3) * 1000)
            decision = policy.choose(block_hashes, num_tokens, replicas)
            policy.record_routed(decision, block_hashes)
            decisions.append((decision.replica_id, decision.reason))
        return decisions

    assert route(True) == route(False)


def test_decode_prefers_the_replica_holding_the_adapter_and_leaves_the_base_model_alone():
    policy = DecodePolicy(DecodePolicyConfig(block_size=BLOCK))
    loads = [ReplicaLoad("a", num_active_requests=2, adapters=("y", "z"), max_loras=2),
             ReplicaLoad("b", num_active_requests=3, adapters=("x", "z"), max_loras=2),
             ReplicaLoad("c", num_active_requests=3, adapters=("y",), max_loras=2)]
    # b holds x; c has a free slot for it, a must evict one and may wait: 3 < 3 + 1 < 2 + 2 + 4.
    for _ in range(20):
        assert policy.choose(loads, {}, 64, adapter="x").replica_id == "b"
    config = policy.config
    assert policy._adapter_cost(loads[0], "x") == 2 * config.w_adapter_load + config.w_adapter_wait
    assert policy._adapter_cost(loads[2], "x") == config.w_adapter_load
    # Without an adapter: the fewest active decodes, as before.
    assert policy.choose(loads, {}, 64).replica_id == "a"
    decision = policy.choose(loads, {}, 64, adapter="x")
    policy.record_routed(decision)
    assert policy.adapters_sent.fit("x", "b", (), 2) is AdapterFit.HELD
    policy.reported("b")
    assert policy.adapters_sent.fit("x", "b", (), 2) is AdapterFit.LOAD


def test_latency_prices_the_copy_and_the_wait_in_seconds():
    policy = PredictedLatencyPolicy(LatencyPolicyConfig(
        block_size=BLOCK, max_num_batched_tokens=256, max_routed_ratio=None, explore_fraction=0.0, prior=COST,
        adapter_load_s=0.01))
    block_hashes, num_tokens = prompt(64, "x")
    held = ReplicaLoad("a", adapters=("x",), max_loras=1)
    free = ReplicaLoad("b", max_loras=1)
    full = ReplicaLoad("c", adapters=("y",), max_loras=1)
    assert policy.adapter_seconds(held, "x") == (0.0, 0.0)
    assert policy.adapter_seconds(free, "x") == (0.01, 0.0)
    wait_s, reload_s = policy.adapter_seconds(full, "x")
    assert reload_s == 0.01
    assert wait_s == pytest.approx(0.01 + policy.predictor.compute_s("c", policy.config.adapter_wait_tokens, 0.0))
    # Equal queues and no prefix anywhere: the holder wins, and its prediction carries no copy.
    decision = policy.choose(block_hashes, num_tokens, [full, free, held], adapter="x")
    assert decision.replica_id == "a"
    base = policy.choose(block_hashes, num_tokens, [held])
    assert decision.predicted_s == pytest.approx(base.predicted_s)
    only_free = policy.choose(block_hashes, num_tokens, [free], adapter="x")
    assert only_free.predicted_s == pytest.approx(base.predicted_s + 0.01)


def test_latency_before_data_prices_the_adapter_in_tokens():
    policy = PredictedLatencyPolicy(LatencyPolicyConfig(block_size=BLOCK))
    assert not policy.predictor.ready()
    block_hashes, num_tokens = prompt(64, "x")
    loads = [ReplicaLoad("a", adapters=("y",), max_loras=1), ReplicaLoad("b", adapters=("x",), max_loras=1)]
    decision = policy.choose(block_hashes, num_tokens, loads, adapter="x")
    assert (decision.replica_id, decision.predicted_s, decision.adapter) == ("b", None, "x")


@pytest.mark.parametrize("config, field", [
    (lambda: PolicyConfig(block_size=BLOCK, adapter_load_tokens=-1.0), "adapter_load_tokens"),
    (lambda: PolicyConfig(block_size=BLOCK, adapter_wait_tokens=-1.0), "adapter_wait_tokens"),
    (lambda: DecodePolicyConfig(block_size=BLOCK, w_adapter_wait=-1.0), "w_adapter_wait"),
    (lambda: LatencyPolicyConfig(block_size=BLOCK, adapter_load_s=-1.0), "adapter_load_s"),
    (lambda: ReplicaLoad("a", max_loras=-1), "negative load"),
])
def test_bad_adapter_settings_are_refused_by_name(config, field):
    with pytest.raises(ValueError, match=field):
        config()
