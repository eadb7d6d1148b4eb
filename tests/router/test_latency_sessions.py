"""The predicted-latency router and sessions: a prompt nobody holds goes where the least work keeps arriving
(a waiting turn's cached history is left out of its replica's report by the engine: ``tests/pd/test_reports.py``)."""

from __future__ import annotations

import math

import pytest

from router.hashing import hash_block_tokens
from router.inflow import Inflow
from router.protocol import RoutingStats
from router.step_cost import prefill_pairs
from tests.router.test_latency import BLOCK, COST, FREE, _candidates, _policy

HISTORY = hash_block_tokens(list(range(256 * BLOCK)), BLOCK)  # a session's 4,096 cached tokens
NUM_TURN_TOKENS = 264 * BLOCK  # the history and 128 new tokens


def _turn(number: int) -> list[bytes]:
    return HISTORY + hash_block_tokens(list(range(100_000 * number, 100_000 * number + 8 * BLOCK)), BLOCK,
                                       parent_hash=HISTORY[-1])



def test_inflow_is_the_prefill_seconds_sent_per_second_lately():
    inflow = Inflow(half_life_s=10.0)
    inflow.sent("a", 2.0, 0.0)
    inflow.sent("a", 2.0, 10.0)  # the first counts half by then
    assert inflow.fraction("a", 10.0) == pytest.approx(3.0 * math.log(2) / 10.0)
    assert inflow.fraction("a", 20.0) == pytest.approx(1.5 * math.log(2) / 10.0)
    assert inflow.fraction("b", 20.0) == 0.0


@pytest.mark.parametrize("w_follow, cold_to", [(3.0, "b"), (0.0, "a")])
def test_a_prompt_nobody_holds_goes_where_the_least_work_keeps_arriving(w_follow, cold_to):
    """a took a session's history and its turns lately and has no queue left; b took nothing and has a
    short queue. A prompt nobody holds would start a little sooner on a, by less than w_follow times its
    prefill's own work times a's recent inflow (the work its session keeps bringing): it goes to b (with
    w_follow 0, to a). The
    session's next turn computes little on a and stays there."""
    policy = _policy(prior=COST, min_steps=1e9, w_follow=w_follow, follow_half_life_s=10.0)
    for name in ("a", "b"):
        policy.observe(name, RoutingStats(num_free_blocks=FREE), 0.0)
    for number in range(1, 9):
        decision = policy.choose(_turn(number), NUM_TURN_TOKENS, _candidates("a"), now_s=0.5 * number)
        policy.record_routed(decision, _turn(number), now_s=0.5 * number)
    policy.observe("a", RoutingStats(num_free_blocks=FREE), 5.0)
    short_queue = dict(num_waiting_tokens=BLOCK, num_waiting_pairs=prefill_pairs(BLOCK, 0), num_free_blocks=FREE)
    policy.observe("b", RoutingStats(**short_queue), 5.0)
    cold = hash_block_tokens(list(range(900_000, 900_000 + NUM_TURN_TOKENS)), BLOCK)
    cold_work = policy.predictor.marginal_s("a", NUM_TURN_TOKENS, prefill_pairs(NUM_TURN_TOKENS, 0))
    assert 0 < policy.predictor.wait_s("b", 5.0) < 3.0 * cold_work * policy.predictor.inflow.fraction("a", 5.0)
    assert policy.choose(cold, NUM_TURN_TOKENS, _candidates("a", "b"), now_s=5.0).replica_id == cold_to
    assert policy.choose(_turn(9), NUM_TURN_TOKENS, _candidates("a", "b"), now_s=5.0).replica_id == "a"


def test_the_inflow_charge_is_for_the_share_of_the_prompt_no_candidate_holds():
    """a holds a 2,048-token system prompt and has taken much work lately; b holds nothing and both are idle.
    A prompt of the system prompt and 2,048 tokens of its own would cost a more than b if a were charged its
    whole inflow, but only its own half is new: a's charge is halved, and a keeps it."""
    policy = _policy(prior=COST, min_steps=1e9, w_follow=3.0, follow_half_life_s=1.0)
    for name in ("a", "b"):
        policy.observe(name, RoutingStats(num_free_blocks=FREE), 0.0)
    for number in range(3):
        work = hash_block_tokens(list(range(500_000 * (number + 1), 500_000 * (number + 1) + NUM_TURN_TOKENS)), BLOCK)
        policy.record_routed(policy.choose(work, NUM_TURN_TOKENS, _candidates("a"), now_s=0.0), work, now_s=0.0)
    policy.observe("a", RoutingStats(num_free_blocks=FREE), 0.0)
    system = list(range(128 * BLOCK))
    policy.index.insert("a", hash_block_tokens(system, BLOCK))
    prompt = system + list(range(700_000, 700_000 + 128 * BLOCK))
    hashes = hash_block_tokens(prompt, BLOCK)
    runs = policy.index.match_tiers(hashes, ["a", "b"])
    _, _, compute_a, ttft_a = policy.predictor.estimate("a", runs.get("a"), len(prompt), 0.0)
    _, _, _, ttft_b = policy.predictor.estimate("b", runs.get("b"), len(prompt), 0.0)
    inflow_a = policy.predictor.inflow.fraction("a", 0.0)
    assert ttft_a + 0.5 * 3.0 * inflow_a * compute_a < ttft_b < ttft_a + 3.0 * inflow_a * compute_a
    assert policy.choose(hashes, len(prompt), _candidates("a", "b"), now_s=0.0).replica_id == "a"


def test_a_short_prompt_is_charged_the_inflow_on_its_own_work_not_the_steps_it_rides_in():
    """a takes half its time in prefills lately and has no decodes; b took nothing and runs 11 decodes, so a
    32-token prompt's step there is twice as long. Charged for a's inflow on its whole prefill (mostly the
    step's constant, which a runs anyway), the prompt went to b; charged on its own tokens' work, it stays on
    a, where it is sooner, and short prompts no longer crowd the replicas that take no long ones."""
    policy = _policy(prior=COST, min_steps=1e9, w_follow=3.0, follow_half_life_s=10.0)
    policy.observe("a", RoutingStats(num_free_blocks=FREE), 0.0)
    policy.observe("b", RoutingStats(num_decoding=11, num_free_blocks=FREE), 0.0)
    policy.predictor.inflow.sent("a", 0.5 * 10.0 / math.log(2), 0.0)  # half of a's time, lately
    assert policy.predictor.inflow.fraction("a", 0.0) == pytest.approx(0.5)
    short = hash_block_tokens(list(range(800_000, 800_000 + 2 * BLOCK)), BLOCK)
    pairs = prefill_pairs(2 * BLOCK, 0)
    a_s, b_s = (policy.predictor.compute_s(name, 2 * BLOCK, pairs) for name in ("a", "b"))
    assert a_s < b_s < a_s * (1 + 3.0 * 0.5)  # the whole-prefill charge would have sent it to b
    assert policy.choose(short, 2 * BLOCK, _candidates("a", "b"), now_s=0.0).replica_id == "a"
