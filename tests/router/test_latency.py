"""The predicted-latency router: it ranks replicas by their predicted time to first token, learns each
replica's speed from its reports, follows a change of speed, and falls back before it has data."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.hashing import hash_block_tokens
from router.latency import LatencyPolicyConfig, LatencyPredictor, PredictedLatencyPolicy, prefill_seconds
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad
from router.protocol import RoutingStats
from router.step_cost import StepShape, StepSums, linear_seconds, prefill_pairs

BLOCK = 16
COST = (2e-3, 4e-5, 2e-9, 1e-4, 2e-4)  # base, per token, per pair, per seq, per sample
FREE = 10**9  # free blocks reported: a cached prefix survives any queue ahead of it


class Replica:
    """A replica's cumulative step sums, grown by steps of a given speed, and its report."""

    def __init__(self, replica_id: str, seed: int) -> None:
        self.replica_id = replica_id
        self.sums = StepSums()
        self.rng = random.Random(seed)

    def run(self, steps: int, speed: float = 1.0) -> None:
        for _ in range(steps):
            if self.rng.random() < 0.5:
                seqs = self.rng.randint(1, 32)
                shape = StepShape(seqs, seqs * self.rng.randint(64, 2048), seqs, seqs)
            else:
                chunk, done = self.rng.randint(16, 512), self.rng.randint(0, 2048)
                shape = StepShape(chunk, chunk * done + chunk * (chunk + 1) // 2, 1, self.rng.randint(0, 1))
            self.sums.record(shape, speed * linear_seconds(COST, shape.vector()))

    def report(self, **load) -> RoutingStats:
        return RoutingStats(step_gram=tuple(self.sums.gram), step_moments=tuple(self.sums.moments), **load)


def _policy(**overrides) -> PredictedLatencyPolicy:
    config = dict(block_size=BLOCK, max_num_batched_tokens=256, min_steps=16, min_replica_steps=4,
                  max_routed_ratio=None, explore_fraction=0.0, w_compute=0.0, w_cached_s=0.0)
    return PredictedLatencyPolicy(LatencyPolicyConfig(**{**config, **overrides}))


def _warm(policy: PredictedLatencyPolicy, replicas: list[Replica], now_s: float = 0.0, speeds=None,
          loads=None) -> None:
    for replica in replicas:
        replica.run(50, (speeds or {}).get(replica.replica_id, 1.0))
        policy.observe(replica.replica_id, replica.report(**(loads or {}).get(replica.replica_id, {})), now_s)


def _candidates(*replica_ids: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id) for replica_id in replica_ids]


def test_it_fits_the_pool_and_prices_a_prompt_as_the_steps_it_takes():
    policy = _policy()
    _warm(policy, [Replica("a", 0), Replica("b", 1)])
    fitted = policy.predictor.fit.coefficients()
    assert fitted == pytest.approx(COST, rel=1e-3)
    # 600 tokens in chunks of 256: three steps, each one sequence, and the tokens and pairs once.
    expected = 3 * (COST[0] + COST[3]) + COST[1] * 600 + COST[2] * (600 * 601 // 2) + COST[4]
    assert policy.predictor.compute_s("a", 600, 600 * 601 // 2) == pytest.approx(expected, rel=1e-3)
    assert prefill_seconds(fitted, 0, 0, 5, 100, 256) == 0.0


def test_it_ranks_replicas_by_predicted_wait_plus_compute():
    """b holds the prompt but has a long queue; a holds nothing and is idle; c holds it and is idle."""
    policy = _policy()
    prompt = list(range(64 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    replicas = [Replica(name, seed) for seed, name in enumerate("abc")]
    _warm(policy, replicas, loads={"b": dict(num_waiting_tokens=20_000, num_waiting_pairs=20_000 * 10_000,
                                                 num_free_blocks=10_000)})
    policy.index.insert("b", hashes)
    decision = policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=0.0)
    assert decision.replica_id == "a"  # recomputing 1,024 tokens beats waiting behind 20,000
    assert decision.predicted_s == pytest.approx(policy.predictor.compute_s("a", len(prompt), len(prompt) * 1025 // 2))
    policy.index.insert("c", hashes)
    assert policy.choose(hashes, len(prompt), _candidates("a", "b", "c"), now_s=0.0).replica_id == "c"
    # Once b's queue has drained (its report said how long it would take), b's hit wins over a's miss.
    later = policy.predictor.wait_s("b", 0.0) + 0.01
    assert policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=later).replica_id == "b"


def test_what_this_router_sent_queues_until_the_next_report():
    policy = _policy()
    _warm(policy, [Replica("a", 0), Replica("b", 1)])
    prompt = list(range(32 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    first = policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=1.0)
    policy.record_routed(first, hashes, now_s=1.0)
    other = hash_block_tokens([token + 10_000 for token in prompt], BLOCK)
    second = policy.choose(other, len(prompt), _candidates("a", "b"), now_s=1.0)
    assert second.replica_id != first.replica_id  # the first prompt's prefill is queued there now
    assert policy.predictor.wait_s(first.replica_id, 1.0) == pytest.approx(first.predicted_s)


def test_it_follows_a_replica_that_slows_down_and_recovers():
    policy = _policy(half_life_s=10.0)
    a, b = Replica("a", 0), Replica("b", 1)
    for second in range(10):
        _warm(policy, [a, b], now_s=float(second))
    assert policy.predictor.fit.speed("b") == pytest.approx(1.0, rel=0.02)
    slow_from = 10
    for second in range(slow_from, slow_from + 60):  # b runs 3x slower from here
        _warm(policy, [a, b], now_s=float(second), speeds={"b": 3.0})
    # Speeds are relative to the pool's fit, which b's slowness drags up: their ratio is b's slowdown.
    fit = policy.predictor.fit
    assert fit.speed("b") / fit.speed("a") == pytest.approx(3.0, rel=0.1)
    prompt = list(range(32 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    assert policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=70.0).replica_id == "a"
    for second in range(70, 130):  # b recovers
        _warm(policy, [a, b], now_s=float(second))
    assert fit.speed("b") / fit.speed("a") == pytest.approx(1.0, rel=0.1)


def test_before_data_the_token_cost_decides():
    config = dict(block_size=BLOCK, seed=3)
    policy = PredictedLatencyPolicy(LatencyPolicyConfig(**config))
    reference = PrefixAffinityPolicy(PolicyConfig(**config))
    prompt = list(range(8 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    for target in (policy, reference):
        target.index.insert("b", hashes)
    candidates = [ReplicaLoad("a"), ReplicaLoad("b", queued_prefill_tokens=100), ReplicaLoad("c")]
    # Reports without step sums (an older replica, or one that has not stepped): still no data.
    policy.observe("a", RoutingStats(), 0.0)
    decision = policy.choose(hashes, len(prompt), candidates, now_s=0.0)
    assert decision.predicted_s is None
    assert decision == reference.choose(hashes, len(prompt), candidates)
    # A prior (a profile's coefficients) predicts from the start.
    primed = PredictedLatencyPolicy(LatencyPolicyConfig(**config, prior=COST))
    assert primed.choose(hashes, len(prompt), candidates, now_s=0.0).predicted_s is not None


def test_exploration_is_bounded():
    """A replica not measured lately wins a near tie, and never a clear loss."""
    policy = _policy(explore_fraction=0.1, explore_after_s=10.0)
    a, b = Replica("a", 0), Replica("b", 1)
    _warm(policy, [a, b], now_s=0.0)
    a.run(50)
    policy.observe("a", a.report(), 100.0)  # b's last measurement is 100 s old now
    prompt = list(range(32 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    assert policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=100.0).replica_id == "b"
    policy.index.insert("a", hashes)  # a holds the whole prompt now: far cheaper than b's recompute
    assert policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=100.0).replica_id == "a"


def test_a_restarted_replica_is_fitted_from_its_new_sums():
    policy = _policy()
    _warm(policy, [Replica("a", 0), Replica("b", 1)])
    fresh = Replica("b", 5)
    fresh.run(10, speed=2.0)
    policy.observe("b", fresh.report(), 1.0)  # its counts went back: a new process
    assert policy.predictor.fit.speed("b") > 1.2


@pytest.mark.parametrize("field, value, message", [
    ("max_num_batched_tokens", 0, "max_num_batched_tokens"),
    ("half_life_s", 0.0, "half_life_s"),
    ("explore_fraction", 1.0, "explore_fraction"),
    ("w_compute", -1.0, "w_compute"),
    ("num_sampled", 0, "num_sampled"),
    ("num_ingress", 0, "num_ingress"),
    ("max_prefix_candidates", -1, "max_prefix_candidates"),
    ("w_cached_s", -0.001, "w_cached_s"),
    ("prior", (1.0, 2.0), "prior"),
])
def test_bad_settings_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        LatencyPolicyConfig(block_size=BLOCK, **{field: value})


def test_bad_step_sums_are_refused():
    with pytest.raises(ValueError, match="step_gram"):
        RoutingStats(step_gram=(1.0,) * 3, step_moments=(1.0,) * 5)
    with pytest.raises(ValueError, match="finite"):
        RoutingStats(step_gram=(float("nan"),) * 15, step_moments=(1.0,) * 5)


def test_decode_placement_weighs_each_replicas_decodes_by_its_measured_speed():
    """Without data the decode policy counts active requests; with it, a replica three times slower counts
    its decodes three times, so a fast replica with more of them still wins."""
    from router.decode_policy import DecodePolicy, DecodePolicyConfig

    policy = _policy(half_life_s=10.0)
    fast, slow = Replica("fast", 0), Replica("slow", 1)
    decode = DecodePolicy(DecodePolicyConfig(block_size=BLOCK, w_kv_usage=0.0, w_recent=0.0),
                          LatencyPredictor(policy.config))
    candidates = [ReplicaLoad("fast", num_active_requests=6), ReplicaLoad("slow", num_active_requests=3)]
    assert decode.choose(candidates, {}, 256).replica_id == "slow"  # no data yet: fewer active requests
    for second in range(20):
        for replica, speed in ((fast, 1.0), (slow, 3.0)):
            replica.run(50, speed)
            decode.predictor.observe(replica.replica_id, replica.report(num_decoding=6 if speed == 1.0 else 3,
                                                                       num_decode_context_tokens=600), float(second))
    assert decode.choose(candidates, {}, 256).replica_id == "fast"


def test_predicted_ttft_is_the_reported_queue_less_the_time_since_plus_the_prompts_own_prefill():
    """A known queue: b reported 3,000 tokens waiting (and their pairs) at t=1; at t=1.02 the prediction on b is
    that backlog's prefill less 20 ms, plus the prompt's uncached prefill after its 32 cached tokens."""
    policy = _policy(prior=COST, min_steps=1e9)  # the prior is the fit: every figure below is exact
    waiting = dict(num_waiting_tokens=3000, num_waiting_pairs=3000 * 1500)
    for name in ("a", "b"):
        policy.observe(name, RoutingStats(num_free_blocks=FREE, **(waiting if name == "b" else {})), 1.0)
    prompt = list(range(40 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    policy.index.insert("b", hashes[:2])
    backlog = prefill_seconds(COST, 3000, 3000 * 1500, 0, 0, 256)
    own = prefill_seconds(COST, len(prompt) - 2 * BLOCK, (len(prompt) - 2 * BLOCK) * 2 * BLOCK
                          + (len(prompt) - 2 * BLOCK) * (len(prompt) - 2 * BLOCK + 1) // 2, 0, 0, 256)
    assert policy.predictor.wait_s("b", 1.02) == pytest.approx(backlog - 0.02)
    on_b = policy.choose(hashes, len(prompt), _candidates("b"), now_s=1.02)
    assert on_b.predicted_s == pytest.approx(backlog - 0.02 + own)
    decision = policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=1.02)
    assert decision.replica_id == "a"  # idle, its whole prefill sooner than b's backlog
    assert decision.predicted_s == pytest.approx(prefill_seconds(COST, len(prompt), len(prompt) * (len(prompt) + 1)
                                                                 // 2, 0, 0, 256))


def test_a_hotspot_costs_its_queue_and_moves_off_once_waiting_outweighs_recomputing():
    """No balance bound: a's history keeps its turns while the queue they build there costs less than
    recomputing the history on idle b; each turn lengthens a's predicted wait by its own prefill; the turn
    whose wait would outweigh the recompute goes to b. A prompt nobody holds goes to b at once."""
    policy = _policy(prior=COST, min_steps=1e9)
    for name in ("a", "b"):
        policy.observe(name, RoutingStats(num_free_blocks=FREE), 0.0)
    history = hash_block_tokens(list(range(256 * BLOCK)), BLOCK)  # 4,096 tokens
    policy.index.insert("a", history)
    turns, waits = [], []
    for turn in range(40):
        tail = hash_block_tokens(list(range(100_000 * (turn + 1), 100_000 * (turn + 1) + 8 * BLOCK)), BLOCK,
                                 parent_hash=history[-1])
        decision = policy.choose(history + tail, 264 * BLOCK, _candidates("a", "b"), now_s=0.0)
        turns.append(decision.replica_id)
        waits.append(policy.predictor.wait_s("a", 0.0))
        if decision.replica_id == "b":
            break
        policy.record_routed(decision, history + tail, now_s=0.0)
    assert turns[:-1] == ["a"] * (len(turns) - 1) and turns[-1] == "b" and len(turns) > 5
    recompute = policy.predictor.compute_s("b", 264 * BLOCK, prefill_pairs(264 * BLOCK, 0))
    assert waits[-2] < recompute <= waits[-1] + policy.predictor.compute_s("a", 8 * BLOCK,
                                                                           prefill_pairs(8 * BLOCK, 256 * BLOCK))
    assert policy.recent.requests("a") > 5 * policy.recent.requests("b")  # far past any balance bound
    cold = hash_block_tokens(list(range(900_000, 900_000 + 264 * BLOCK)), BLOCK)
    assert policy.choose(cold, 264 * BLOCK, _candidates("a", "b"), now_s=0.0).replica_id == "b"


def test_the_guard_charges_what_the_other_ingresses_may_have_sent():
    """One ingress charges a replica what it sent it since its report; one of three charges it three times
    as much (the others may have sent as much); a report replaces either estimate."""
    prompt = list(range(32 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    waits = {}
    for num_ingress in (1, 3):
        policy = _policy(prior=COST, min_steps=1e9, num_ingress=num_ingress)
        policy.observe("a", RoutingStats(), 0.0)
        decision = policy.choose(hashes, len(prompt), _candidates("a"), now_s=0.0)
        policy.record_routed(decision, hashes, now_s=0.0)
        waits[num_ingress] = policy.predictor.wait_s("a", 0.0)
        policy.observe("a", RoutingStats(), 0.5)
        assert policy.predictor.wait_s("a", 0.5) == 0.0
    assert waits[1] == pytest.approx(policy.predictor.compute_s("a", len(prompt), prefill_pairs(len(prompt), 0)))
    assert waits[3] == pytest.approx(3 * waits[1])


def test_a_burst_within_one_report_interval_spreads_over_the_pool():
    """Distinct prompts arriving faster than reports: each queues behind the last this router sent, so the
    burst spreads evenly over 4 idle replicas without any bound."""
    policy = _policy(prior=COST, min_steps=1e9)
    for name in "abcd":
        policy.observe(name, RoutingStats(), 0.0)
    sent = Counter()
    for number in range(40):
        prompt = list(range(10_000 * number, 10_000 * number + 32 * BLOCK))
        hashes = hash_block_tokens(prompt, BLOCK)
        decision = policy.choose(hashes, len(prompt), _candidates(*"abcd"), now_s=0.0)
        policy.record_routed(decision, hashes, now_s=0.0)
        sent[decision.replica_id] += 1
    assert sorted(sent.values()) == [10, 10, 10, 10]


def test_a_decision_scores_a_few_candidates_not_the_pool():
    """256 replicas: the holder of the prompt's prefix and num_sampled others are scored, no more."""
    policy = _policy(prior=COST, min_steps=1e9, num_sampled=3, max_prefix_candidates=2)
    pool = _candidates(*(f"r{i}" for i in range(256)))
    for replica in pool:
        policy.observe(replica.replica_id, RoutingStats(), 0.0)
    prompt = list(range(64 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    policy.index.insert("r200", hashes)
    scored = []
    estimates = policy.predictor.estimates
    policy.predictor.estimates = lambda replica_ids, *args: scored.extend(replica_ids) or estimates(replica_ids, *args)
    decision = policy.choose(hashes, len(prompt), pool, now_s=0.0)
    assert decision.replica_id == "r200" and scored[0] == "r200"
    assert 3 <= len(scored) <= 4 and len(decision.ranked_replica_ids) == len(scored)


def test_recording_a_decision_reuses_the_run_it_matched_while_the_index_is_unchanged():
    """A 64-block prompt held by r3: its decision walks r3's run once (matching), not again when recorded; after
    a change to the index, or for another prompt, the record walks it again."""
    policy = _policy(prior=COST, min_steps=1e9, num_sampled=4)
    pool = _candidates(*(f"r{i}" for i in range(8)))
    for replica in pool:
        policy.observe(replica.replica_id, RoutingStats(), 0.0)
    hashes = hash_block_tokens(list(range(64 * BLOCK)), BLOCK)
    policy.index.insert("r3", hashes)
    walks = []
    run_of = policy.index._run_of
    policy.index._run_of = lambda replica_id, *args: walks.append(replica_id) or run_of(replica_id, *args)
    decision = policy.choose(hashes, 64 * BLOCK, pool, now_s=0.0)
    assert decision.replica_id == "r3" and walks == ["r3"]
    policy.record_routed(decision, hashes)
    assert walks == ["r3"] and policy.index.match(hashes) == {"r3": 64}
    decision = policy.choose(hashes, 64 * BLOCK, pool, now_s=0.0)  # r3's queue may send this one elsewhere
    policy.index.evict("r3", hashes[60:])  # a report applied between the decision and its record
    policy.record_routed(decision, hashes)
    assert walks == ["r3", "r3", decision.replica_id] and policy.index.match(hashes)[decision.replica_id] == 64
    decision = policy.choose(hashes, 64 * BLOCK, pool, now_s=0.0)
    matched = len(walks)
    policy.record_routed(decision, list(hashes))  # another prompt object: nothing known of it
    assert walks[matched:] == [decision.replica_id]


def test_a_cold_prompt_goes_where_the_fewest_cached_blocks_are():
    """Two idle replicas predicted alike for a prompt neither holds: the one whose cache holds less (where fewer
    later requests will follow) takes it. Without the charge, a coin decides."""
    prompt = list(range(900_000, 900_000 + 32 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    chosen = {}
    for w_cached_s in (0.0, 0.005):
        policy = _policy(prior=COST, min_steps=1e9, w_cached_s=w_cached_s)
        for name in ("a", "b"):
            policy.observe(name, RoutingStats(num_free_blocks=FREE), 0.0)
        policy.index.insert("a", hash_block_tokens(list(range(200 * BLOCK)), BLOCK))  # a long session's history
        policy.index.insert("b", hash_block_tokens(list(range(500_000, 500_000 + 20 * BLOCK)), BLOCK))
        chosen[w_cached_s] = Counter(policy.choose(hashes, len(prompt), _candidates("a", "b")).replica_id
                                     for _ in range(40))
    assert chosen[0.005] == Counter(b=40)
    assert chosen[0.0]["a"] > 5 and chosen[0.0]["b"] > 5


def test_in_a_colocated_pool_a_request_sent_decodes_there_until_the_next_report():
    """Each request sent to a replica whose pool decodes its own prefills slows that replica's later steps: the
    next prompt's prefill there is priced with one more decode per step. A prefill pool's requests decode
    elsewhere; a report replaces the count."""
    prompt = list(range(32 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    pairs = prefill_pairs(len(prompt), 0)
    for decodes_here, extra in ((False, 0), (True, 1)):
        policy = _policy(prior=COST, min_steps=1e9, decodes_here=decodes_here)
        policy.observe("a", RoutingStats(num_free_blocks=FREE, num_decoding=2), 0.0)
        before = policy.predictor.compute_s("a", len(prompt), pairs)
        policy.record_routed(policy.choose(hashes, len(prompt), _candidates("a")), hashes, 0.0)
        expected = prefill_seconds(COST, len(prompt), pairs, 2 + extra, 0, 256)
        assert policy.predictor.compute_s("a", len(prompt), pairs) == pytest.approx(expected)
        assert (policy.predictor.compute_s("a", len(prompt), pairs) > before) is decodes_here
        policy.observe("a", RoutingStats(num_free_blocks=FREE, num_decoding=2), 1.0)
        assert policy.predictor.compute_s("a", len(prompt), pairs) == pytest.approx(before)


def test_predictions_are_python_floats_that_a_wire_and_a_clock_take():
    # A numpy scalar from the fit's sums leaked into each prediction, thence into flow control's expiry times
    # and the simulator's clock, until msgspec refused a KV handle's lease expiry.
    policy = _policy(half_life_s=10.0)
    a, b = Replica("a", 0), Replica("b", 1)
    for second in range(10):
        _warm(policy, [a, b], now_s=float(second), speeds={"b": 2.0})
    fit = policy.predictor.fit
    assert type(fit.speed("a")) is float and type(fit.speed("b")) is float and type(fit.fastest()) is float
    prompt = list(range(8 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    runs = policy.index.match_tiers(hashes)
    prediction = policy.predictor.best(runs, len(prompt), ["a", "b"], 10.0)
    assert type(prediction.ttft_s) is float and type(prediction.compute_s) is float
