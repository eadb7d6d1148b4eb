"""The predicted-latency router: it ranks replicas by their predicted time to first token, learns each
replica's speed from its reports, follows a change of speed, and falls back before it has data."""

from __future__ import annotations

import random

import pytest

from router.hashing import hash_block_tokens
from router.latency import LatencyPolicyConfig, LatencyPredictor, PredictedLatencyPolicy, prefill_seconds
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad
from router.protocol import RoutingStats
from router.step_cost import StepShape, StepSums, linear_seconds

BLOCK = 16
COST = (2e-3, 4e-5, 2e-9, 1e-4, 2e-4)  # base, per token, per pair, per seq, per sample


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
                  max_routed_ratio=None, explore_fraction=0.0, w_compute=0.0)
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


def test_a_long_history_stays_on_its_holder_past_the_bound_that_moves_cold_traffic():
    """The holder of a long history has been sent 1.6x the least-routed replica's recent requests: over
    max_routed_ratio (1.45), within hot_routed_ratio (1.8). The history's next turn still goes there; a
    prompt nobody holds does not, and neither does one once the holder passes 1.8x."""
    policy = _policy(max_routed_ratio=1.45, cold_routed_ratio=1.15, hot_routed_ratio=1.8, bound_exempt_tokens=1024)
    _warm(policy, [Replica("a", 0), Replica("b", 1)])
    history = list(range(256 * BLOCK))  # 4,096 tokens
    turn = history + list(range(50_000, 50_000 + 4 * BLOCK))
    policy.index.insert("a", hash_block_tokens(history, BLOCK))
    recent = policy.recent
    recent.requests_of(["a", "b"])  # both known before any is recorded
    for _ in range(30):
        recent.record("b", 0)
    for _ in range(48):
        recent.record("a", 0)
    assert 1.45 < recent.requests("a") / recent.requests("b") < 1.8
    hashes = hash_block_tokens(turn, BLOCK)
    assert policy.choose(hashes, len(turn), _candidates("a", "b")).replica_id == "a"
    cold = [token + 100_000 for token in turn]
    assert policy.choose(hash_block_tokens(cold, BLOCK), len(cold), _candidates("a", "b")).replica_id == "b"
    for _ in range(20):
        recent.record("a", 0)
    assert policy.choose(hashes, len(turn), _candidates("a", "b")).replica_id == "b"
