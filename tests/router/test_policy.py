import dataclasses
import random
from collections import Counter

import pytest

from router.decode_policy import DecodePolicy, DecodePolicyConfig
from router.hashing import hash_block_tokens
from router.policy import (
    PolicyConfig,
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoutingDecision,
    RoutingReason,
    uncached_tokens,
)
from router.prefix_index import PrefixIndex
from router.tiers import Tier

BLOCK = 16


def prompt(num_tokens: int, first_token: int = 0) -> tuple[list[bytes], int]:
    """(block hashes, token count) of a prompt of ``num_tokens`` distinct tokens."""
    return hash_block_tokens(list(range(first_token, first_token + num_tokens)), BLOCK), num_tokens


def idle(*replica_ids: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id) for replica_id in replica_ids]


def make_policy(**overrides) -> PrefixAffinityPolicy:
    return PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, **overrides))


def test_longest_prefix_wins_at_equal_load():
    block_hashes, num_tokens = prompt(100)  # 6 full blocks
    policy = make_policy()
    policy.index.insert("a", block_hashes[:2])
    policy.index.insert("b", block_hashes[:5])
    decision = policy.choose(block_hashes, num_tokens, idle("a", "b", "c"))
    assert decision.replica_id == "b"
    assert decision.reason is RoutingReason.PREFIX
    assert decision.matched_tokens == 80
    assert decision.uncached_tokens == 20
    assert decision.ranked_replica_ids == ("b", "a", "c")


def test_cost_is_weighted_uncached_tokens_plus_weighted_load():
    block_hashes, num_tokens = prompt(64)  # a holds 48 of 64 tokens
    policy = make_policy(w_prefix=1.0, w_load=1.0, request_load_tokens=0.0, kv_usage_load_tokens=0.0)
    policy.index.insert("a", block_hashes[:3])
    # a: 16 uncached + 47 queued = 63 < b: 64 uncached + 0 queued
    loads = [ReplicaLoad("a", queued_prefill_tokens=47), ReplicaLoad("b")]
    assert policy.choose(block_hashes, num_tokens, loads).replica_id == "a"
    # a: 16 + 49 = 65 > b: 64. The longer prefix sits on a busier replica.
    loads = [ReplicaLoad("a", queued_prefill_tokens=49), ReplicaLoad("b")]
    decision = policy.choose(block_hashes, num_tokens, loads)
    assert (decision.replica_id, decision.reason, decision.matched_tokens) == ("b", RoutingReason.LOAD, 0)
    # Active requests and KV usage count as load too.
    policy = make_policy(w_prefix=1.0, w_load=1.0, request_load_tokens=10.0, kv_usage_load_tokens=100.0)
    policy.index.insert("a", block_hashes[:3])
    loads = [ReplicaLoad("a", num_active_requests=2, kv_usage=0.25), ReplicaLoad("b")]  # 16 + 20 + 25 = 61 < 64
    assert policy.choose(block_hashes, num_tokens, loads).replica_id == "a"
    loads = [ReplicaLoad("a", num_active_requests=2, kv_usage=0.3), ReplicaLoad("b")]  # 16 + 20 + 30 = 66 > 64
    assert policy.choose(block_hashes, num_tokens, loads).replica_id == "b"


def test_the_last_prompt_token_is_always_computed():
    block_hashes, num_tokens = prompt(48)  # exactly 3 full blocks
    policy = make_policy()
    policy.index.insert("a", block_hashes)
    decision = policy.choose(block_hashes, num_tokens, idle("a", "b"))
    assert (decision.replica_id, decision.matched_tokens, decision.uncached_tokens) == ("a", 47, 1)


def test_no_prefix_anywhere_goes_to_the_least_loaded():
    block_hashes, num_tokens = prompt(40)
    policy = make_policy()
    loads = [ReplicaLoad("a", queued_prefill_tokens=100), ReplicaLoad("b", num_active_requests=1), ReplicaLoad("c")]
    decision = policy.choose(block_hashes, num_tokens, loads)
    assert (decision.replica_id, decision.reason) == ("c", RoutingReason.LOAD)
    assert decision.ranked_replica_ids == ("c", "a", "b")  # loads 0, 100, 256


def test_overload_guard_passes_over_the_best_match():
    block_hashes, num_tokens = prompt(320)
    policy = make_policy(max_kv_usage=0.9, max_active_requests=4, max_queued_prefill_tokens=1000)
    policy.index.insert("a", block_hashes)
    policy.index.insert("b", block_hashes[:2])
    over_bound = [
        ReplicaLoad("a", kv_usage=0.95),
        ReplicaLoad("a", num_active_requests=5),
        ReplicaLoad("a", queued_prefill_tokens=1001),
    ]
    for overloaded_a in over_bound:
        decision = policy.choose(block_hashes, num_tokens, [overloaded_a, ReplicaLoad("b"), ReplicaLoad("c")])
        assert (decision.replica_id, decision.reason, decision.matched_tokens) == ("b", RoutingReason.OVERLOAD, 32)
        assert decision.ranked_replica_ids[-1] == "a"
    # At the bound is within it.
    decision = policy.choose(block_hashes, num_tokens, [ReplicaLoad("a", num_active_requests=4), ReplicaLoad("b")])
    assert (decision.replica_id, decision.reason) == ("a", RoutingReason.PREFIX)


def test_when_every_replica_is_over_bound_all_are_scored():
    block_hashes, num_tokens = prompt(160)
    policy = make_policy(max_active_requests=1)
    policy.index.insert("a", block_hashes)
    loads = [ReplicaLoad("a", num_active_requests=3), ReplicaLoad("b", num_active_requests=2)]
    decision = policy.choose(block_hashes, num_tokens, loads)
    assert (decision.replica_id, decision.reason) == ("a", RoutingReason.OVERLOAD)


def test_shared_system_prompt_spreads_instead_of_pinning():
    """Ray Serve LLM's prefix router sent 400/0/0/0 here; prefix alone would too."""
    system_tokens = list(range(32 * BLOCK))

    def route_all(policy: PrefixAffinityPolicy) -> Counter:
        counts = Counter()
        for request in range(400):
            user_tokens = list(range(10_000 + 100 * request, 10_000 + 100 * request + 2 * BLOCK))
            block_hashes = hash_block_tokens(system_tokens + user_tokens, BLOCK)
            decision = policy.choose(block_hashes, 34 * BLOCK, idle("a", "b", "c", "d"))
            policy.record_routed(decision, block_hashes)
            counts[decision.replica_id] += 1
        return counts

    # Prefix only (no load weight, no bound): everything follows the first request.
    pinned = route_all(make_policy(w_load=0.0, max_routed_ratio=None))
    assert sorted(pinned.values()) == [400]
    # The routed-ratio bound alone spreads it, with the reason recorded.
    bounded_policy = make_policy(w_load=0.0, max_routed_ratio=1.5)
    bounded = route_all(bounded_policy)
    assert len(bounded) == 4 and max(bounded.values()) / min(bounded.values()) <= 1.5
    assert bounded_policy.reason_counts[RoutingReason.OVERLOAD] > 0
    # The defaults spread it too.
    spread = route_all(make_policy())
    assert len(spread) == 4 and max(spread.values()) / min(spread.values()) <= 1.5


def test_ties_break_at_random_reproducibly():
    block_hashes, num_tokens = prompt(40)
    draws = {}
    for seed in (1, 1, 2):
        policy = make_policy(seed=seed)
        chosen = [policy.choose(block_hashes, num_tokens, idle("a", "b", "c")).replica_id for _ in range(300)]
        draws.setdefault(seed, []).append(chosen)
        assert set(chosen) == {"a", "b", "c"}
        assert min(Counter(chosen).values()) > 60
    assert draws[1][0] == draws[1][1]  # same seed, same draws
    assert draws[1][0] != draws[2][0]
    # Only the tied ones are drawn.
    policy = make_policy()
    policy.index.insert("a", block_hashes[:1])
    policy.index.insert("b", block_hashes[:1])
    chosen = {policy.choose(block_hashes, num_tokens, idle("a", "b", "c")).replica_id for _ in range(100)}
    assert chosen == {"a", "b"}


def test_record_routed_inserts_optimistically_and_counts_reasons():
    block_hashes, num_tokens = prompt(64)
    policy = make_policy()
    decision = policy.choose(block_hashes, num_tokens, idle("a", "b"))
    policy.record_routed(decision, block_hashes)
    assert policy.index.match(block_hashes) == {decision.replica_id: 4}
    again = policy.choose(block_hashes, num_tokens, idle("a", "b"))
    assert (again.replica_id, again.reason) == (decision.replica_id, RoutingReason.PREFIX)
    policy.record_routed(again, block_hashes)
    # The request landed elsewhere than decided: record where it went.
    other = "b" if decision.replica_id == "a" else "a"
    policy.record_routed(dataclasses.replace(again, replica_id=other), block_hashes)
    assert policy.index.match(block_hashes) == {"a": 4, "b": 4}
    assert policy.reason_counts == Counter({RoutingReason.LOAD: 1, RoutingReason.PREFIX: 2})


def test_recent_routing_counts_as_load():
    block_hashes, num_tokens = prompt(40)
    policy = make_policy(recent_request_load_tokens=100.0, recent_prefill_weight=0.0)
    first = policy.choose(block_hashes, num_tokens, idle("a", "b"))
    policy.record_routed(first, [])
    # The same unmatched prompt now goes to the other replica: the first one was just sent a request.
    second = policy.choose(block_hashes, num_tokens, idle("a", "b"))
    assert second.replica_id != first.replica_id


def test_prefill_sent_since_a_replica_reported_counts_as_its_queue():
    """Reports lag: what this router sent a replica since its last one is queued work the report cannot show."""
    policy = make_policy(w_prefix=1.0, recent_prefill_weight=0.0, recent_request_load_tokens=0.0,
                         request_load_tokens=0.0, max_routed_ratio=None)
    long_prompt, long_len = prompt(400)
    first = policy.choose(long_prompt, long_len, idle("a", "b"))
    policy.record_routed(first, long_prompt)
    other = "b" if first.replica_id == "a" else "a"
    # b's report still says idle; a's says 100 queued tokens, and it holds 384 of the next prompt's 400.
    # Unsent-since-report, a would win (16 + 100 < 400 + 0); with a's 400 unreported tokens it loses.
    loads = [ReplicaLoad(first.replica_id, queued_prefill_tokens=100), ReplicaLoad(other)]
    assert policy.choose(long_prompt, long_len, loads).replica_id == other
    # a reports again: its queue figure now includes that prompt, and nothing is counted twice.
    policy.reported(first.replica_id)
    assert policy.choose(long_prompt, long_len, loads).replica_id == first.replica_id
    # Off (weight 0): the lagging report is all there is.
    stale = make_policy(w_prefix=1.0, recent_prefill_weight=0.0, recent_request_load_tokens=0.0,
                        request_load_tokens=0.0, max_routed_ratio=None, unreported_prefill_weight=0.0)
    stale.record_routed(first, long_prompt)
    assert stale.choose(long_prompt, long_len, loads).replica_id == first.replica_id


def test_uncached_tokens_counts_from_the_best_holder():
    block_hashes, num_tokens = prompt(100)
    index = PrefixIndex(100)
    assert uncached_tokens(index.match(block_hashes), BLOCK, num_tokens) == 100
    index.insert("a", block_hashes[:2])
    index.insert("b", block_hashes[:5])
    assert uncached_tokens(index.match(block_hashes), BLOCK, num_tokens) == 20
    assert uncached_tokens({"a": 2}, BLOCK, num_tokens) == 68
    assert uncached_tokens({}, BLOCK, num_tokens) == 100
    assert uncached_tokens({"b": 7}, BLOCK, num_tokens) == 1  # the last token is always computed


def test_remove_replica_forgets_its_blocks():
    block_hashes, num_tokens = prompt(64)
    policy = make_policy()
    policy.index.insert("a", block_hashes)
    policy.remove_replica("a")
    assert policy.index.match(block_hashes) == {}


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError):
        make_policy().choose([], 10, [])
    with pytest.raises(ValueError):
        DecodePolicy(DecodePolicyConfig(block_size=BLOCK)).choose([], {}, 10)


@pytest.mark.parametrize("overrides", [
    dict(block_size=0), dict(w_prefix=-1.0), dict(w_prefix=0.0, w_load=0.0), dict(max_kv_usage=0.0),
    dict(max_kv_usage=1.5), dict(max_active_requests=0), dict(max_routed_ratio=0.5), dict(recent_window=0),
    dict(index_max_blocks=0), dict(recent_prefill_weight=-0.1),
])
def test_config_rejects_invalid_values(overrides):
    with pytest.raises(ValueError):
        PolicyConfig(**{"block_size": BLOCK, **overrides})


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PolicyConfig(block_size=BLOCK).w_prefix = 2.0


@pytest.mark.parametrize("fields", [dict(kv_usage=1.5), dict(kv_usage=-0.1), dict(num_active_requests=-1),
                                    dict(queued_prefill_tokens=-5)])
def test_replica_load_rejects_invalid_values(fields):
    with pytest.raises(ValueError):
        ReplicaLoad("a", **fields)


def make_decode_policy(**overrides) -> DecodePolicy:
    return DecodePolicy(DecodePolicyConfig(block_size=BLOCK, **overrides))


def test_decode_prefers_kv_headroom_and_few_active_requests():
    policy = make_decode_policy()
    loads = [ReplicaLoad("a", num_active_requests=3, kv_usage=0.5), ReplicaLoad("b", num_active_requests=3, kv_usage=0.2),
             ReplicaLoad("c", num_active_requests=6, kv_usage=0.1)]
    decision = policy.choose(loads, {}, 64)
    # costs: a = 3 + 4.0, b = 3 + 1.6, c = 6 + 0.8
    assert (decision.replica_id, decision.reason, decision.uncached_tokens) == ("b", RoutingReason.LOAD, 64)
    assert decision.ranked_replica_ids == ("b", "c", "a")


def test_decode_prefix_hits_earn_a_bonus():
    policy = make_decode_policy(w_prefix_hit=2.0)
    loads = [ReplicaLoad("a", num_active_requests=4), ReplicaLoad("b", num_active_requests=3)]
    # a holds the whole 64-token prompt (63 reusable): 4 - 2 * 63/64 < 3
    decision = policy.choose(loads, {"a": 4}, 64)
    assert (decision.replica_id, decision.reason, decision.matched_tokens) == ("a", RoutingReason.PREFIX, 63)
    # Half the prompt is not worth one more active request.
    decision = policy.choose(loads, {"a": 2}, 64)
    assert decision.replica_id == "b"
    assert decision.reason is RoutingReason.LOAD


def test_decode_guard_passes_over_a_full_kv_cache():
    policy = make_decode_policy(max_kv_usage=0.9)
    loads = [ReplicaLoad("a", kv_usage=0.95), ReplicaLoad("b", num_active_requests=20, kv_usage=0.8)]
    decision = policy.choose(loads, {"a": 4}, 64)
    assert (decision.replica_id, decision.reason) == ("b", RoutingReason.OVERLOAD)
    policy.record_routed(decision)
    assert policy.reason_counts == Counter({RoutingReason.OVERLOAD: 1})


def test_decode_ties_break_at_random():
    policy = make_decode_policy(seed=3)
    chosen = Counter(policy.choose(idle("a", "b"), {}, 64).replica_id for _ in range(200))
    assert set(chosen) == {"a", "b"} and min(chosen.values()) > 60


@pytest.mark.integration  # a child Python checks a fresh import
def test_policy_module_does_not_import_ray():
    import subprocess
    import sys

    code = "import sys, router.policy, router.prefix_index; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_decision_is_a_value():
    decision = RoutingDecision("a", RoutingReason.PREFIX, 10, 6)
    assert dataclasses.replace(decision, replica_id="b").replica_id == "b"


def test_a_burst_of_decodes_spreads_before_the_next_report():
    """Reports come once a period: eight requests in between must not all follow the last one."""
    block_hashes, num_tokens = prompt(64)
    policy = make_decode_policy()
    loads = [ReplicaLoad("a"), ReplicaLoad("b")]
    placed = Counter()
    for _ in range(8):
        decision = policy.choose(loads, {"a": 4}, num_tokens)  # "a" holds the whole prompt
        policy.record_routed(decision)
        placed[decision.replica_id] += 1
    assert placed["b"] >= 2 and placed["a"] >= placed["b"], placed


def test_recent_routed_decays_everyone_per_decision_without_touching_everyone():
    """O(1) per decision (a running scale), equal to multiplying every replica's counts at every decision."""
    from router.recent import RecentRouted

    recent, rng, decay = RecentRouted(window=16), random.Random(0), 1 - 1 / 16
    expected: dict[str, list[float]] = {}
    for _ in range(5000):  # far past the renormalisation (the scale falls below 1e-100 near 3,600 decisions)
        replica, tokens = f"r{rng.randrange(5)}", rng.randrange(100)
        if replica not in expected:
            mean = [sum(v[i] for v in expected.values()) / len(expected) if expected else 0.0 for i in (0, 1)]
            recent.requests(replica)  # admitted at the mean, as the policy admits a newcomer
            expected[replica] = mean
        recent.record(replica, tokens)
        for counts in expected.values():
            counts[0] *= decay
            counts[1] *= decay
        expected[replica][0] += 1
        expected[replica][1] += tokens
    for replica, (requests, prefill_tokens) in expected.items():
        assert recent.requests(replica) == pytest.approx(requests, rel=1e-9)
        assert recent.prefill_tokens(replica) == pytest.approx(prefill_tokens, rel=1e-9)


def test_recent_routed_reads_many_as_it_reads_each_admitting_newcomers_in_order():
    from router.recent import RecentRouted

    one_by_one, at_once = RecentRouted(window=8), RecentRouted(window=8)
    for recent in (one_by_one, at_once):
        for replica in ("a", "a", "b", "a"):
            recent.record(replica, 0)
    ids = ["b", "new-1", "a", "new-2"]
    expected = [one_by_one.requests(replica) for replica in ids]
    assert at_once.requests_of(ids) == expected  # exactly: the router's ties depend on it
    assert expected[1] == pytest.approx((expected[0] + expected[2]) / 2)  # a newcomer starts at the mean
    assert expected[3] == pytest.approx(sum(expected[:3]) / 3)  # of everyone known by then, the first newcomer too


def test_decode_policy_decides_alike_whether_a_replica_without_a_match_is_absent_or_empty():
    loads = [ReplicaLoad(f"r{index}", num_active_requests=index % 3, kv_usage=0.1 * (index % 4)) for index in range(12)]
    matches = {"r5": (Tier.DEVICE,) * 3, "r7": 2}
    config = DecodePolicyConfig(block_size=16, seed=3)
    absent = DecodePolicy(config).choose(loads, matches, 100)
    empty = DecodePolicy(config).choose(loads, {**matches, "r1": (), "r2": 0}, 100)
    assert absent == empty
