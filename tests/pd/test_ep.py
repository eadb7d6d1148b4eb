"""Expert parallelism: dispatch and combine over real gloo all-to-alls, weight moves, EPLB's schedule, and
whole engines of two ranks against one (and HF), through a live rebalance, and their refusals (a dead rank:
tests/pd/test_tensor_parallel.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.engine.ep.dispatch import ExpertParallel, initial_placement, token_slice
from pd.engine.ep.moves import Move, align, plan_moves, receives, sends
from pd.engine.ep.placement import Placement, rebalance
from pd.engine.ep.schedule import EplbSchedule
from pd.engine.tp.group import TPGroup
from pd.model.config import MoeConfig, model_config_from_dict
from pd.model.linear import make_linear
from pd.model.moe import MoeWeights, moe_block
from pd.model.tp import TPShard, check_tp
from tests.reference import assert_greedy_match, hf_greedy

CPU = torch.device("cpu")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


def run_ranks(size: int, body, timeout_s: float = 30.0) -> list:
    """``body(group)`` on ``size`` real gloo ranks, one thread each; every rank's result, in rank order."""
    groups = [TPGroup(0, size, "127.0.0.1", 0, CPU, timeout_s)]
    groups += [TPGroup(r, size, "127.0.0.1", groups[0].port, CPU, timeout_s) for r in range(1, size)]
    results, errors = [None] * size, []

    def rank(r: int) -> None:
        try:
            groups[r].connect()
            results[r] = body(groups[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    for group in groups:
        group.close()
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


def full_weights(seed: int = 0, shared: bool = False, gate: torch.Tensor | None = None) -> MoeWeights:
    gen = torch.Generator().manual_seed(seed)
    weights = MoeWeights(
        gate=make_linear(gate if gate is not None else torch.randn(EXPERTS, HIDDEN, generator=gen) * 2, None, "dense"),
        w13=torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3,
        w2=torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3)
    if shared:
        weights.shared_gate_up = make_linear(torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.3, None, "dense")
        weights.shared_down = make_linear(torch.randn(HIDDEN, INTER, generator=gen) * 0.3, None, "dense")
        weights.shared_expert_gate = make_linear(torch.randn(1, HIDDEN, generator=gen), None, "dense")
    return weights


def rank_weights(full: MoeWeights, held: tuple[int, ...]) -> MoeWeights:
    """What an expert-parallel rank holds of ``full``: its experts in slot order, the rest shared."""
    ids = torch.tensor(held)
    return MoeWeights(full.gate, full.w13[ids].clone(), full.w2[ids].clone(), full.shared_gate_up,
                      full.shared_down, full.shared_expert_gate)


CONFIG = MoeConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER, renormalize=True,
                   layers=(True,))


def one_rank(seed: int, rows: int = 9) -> tuple[MoeWeights, torch.Tensor, torch.Tensor]:
    """Random weights, a batch of ``rows`` tokens, and one rank's block output for it."""
    full = full_weights(seed=seed)
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    return full, hidden, moe_block(full, CONFIG, hidden, rows, "cpu")


def ep_outputs(size: int, full: MoeWeights, hidden: torch.Tensor, num_tokens: int, redundant: int = 0,
               dispatch: str = "all_to_all") -> list:
    def body(group):
        ep = ExpertParallel(group, 1, [0], EXPERTS, redundant, 8, 8, CPU, dispatch)
        out = ep.moe_block(0, rank_weights(full, ep.held(0)), CONFIG, hidden, num_tokens, "cpu")
        return out, ep.load.counts()[0].clone()
    return run_ranks(size, body)


def test_token_slices_cover_the_batch_once_and_may_be_empty():
    assert [token_slice(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [token_slice(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]
    assert [token_slice(0, r, 3) for r in range(3)] == [(0, 0)] * 3
    assert [token_slice(7, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_reduce"])
@pytest.mark.parametrize("num_tokens, rows, size, redundant, shared", [
    (5, 5, 2, 0, False),  # uneven slices: 3 and 2 tokens
    (1, 1, 2, 0, False),  # rank 1 routes nothing, still serves its experts
    (6, 8, 2, 2, True),  # padding rows after the batch, replicas, a shared expert
    (7, 7, 4, 0, False),  # four ranks: the last slice shorter
])
def test_dispatch_and_combine_equal_one_rank(num_tokens, rows, size, redundant, shared, dispatch):
    full = full_weights(shared=shared)
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = moe_block(full, CONFIG, hidden, num_tokens, "cpu")
    results = ep_outputs(size, full, hidden, num_tokens, redundant, dispatch)
    for out, _ in results:
        torch.testing.assert_close(out[:num_tokens], expected[:num_tokens], rtol=1e-5, atol=1e-5)
        assert not out[num_tokens:].any()  # padding rows stay zero
    # Each rank counted its own slice's routing; together, every (token, expert) pair once.
    assert sum(int(counts.sum()) for _, counts in results) == num_tokens * TOP_K


def test_a_rank_that_receives_nothing_still_takes_part():
    """Every token picks experts 0 and 1 (rank 0's): rank 1 sends all its pairs away and receives none."""
    gate = torch.full((EXPERTS, HIDDEN), -1.0)
    gate[:2] = 1.0
    full = full_weights(gate=gate)
    hidden = torch.rand(6, HIDDEN, generator=torch.Generator().manual_seed(2)) + 0.1
    expected = moe_block(full, CONFIG, hidden, 6, "cpu")
    results = ep_outputs(2, full, hidden, 6)
    for out, counts in results:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert counts[2:].sum() == 0


def test_moves_are_planned_from_own_slots_first_and_ordered_alike_on_both_ends():
    old = Placement(((0, 1), (2, 3)), 4)
    new = Placement(((0, 2), (1, 3)), 4)
    moves = plan_moves(old, new)
    assert moves == [Move(0, 0, 0, 0, 0), Move(2, 1, 0, 0, 1), Move(1, 0, 1, 1, 0), Move(3, 1, 1, 1, 1)]
    assert sends(moves, 0, 2) == [[], [Move(1, 0, 1, 1, 0)]]
    assert receives(moves, 1, 2) == [[Move(1, 0, 1, 1, 0)], []]
    # A new replica is fetched from the old replicas in turn, by the destination's rank.
    old = Placement(((0, 1), (0, 2), (3, 1)), 4)
    new = Placement(((2, 3), (3, 0), (1, 2)), 4)
    assert [(m.expert, m.src_rank) for m in plan_moves(old, new)] == [(2, 1), (3, 2), (3, 2), (0, 1), (1, 2),
                                                                      (2, 1)]
    with pytest.raises(ValueError, match="not one layer's"):
        plan_moves(old, Placement(((0, 1), (2, 3)), 4))


def test_aligned_placements_keep_a_kept_expert_in_its_slot():
    old = Placement(((0, 1, 2), (3, 4, 5)), 6)
    assert align(old, Placement(((1, 2, 5), (0, 3, 4)), 6)).slots == ((5, 1, 2), (3, 4, 0))
    assert align(old, Placement(((0, 0, 1), (2, 3, 4)), 6)).slots == ((0, 1, 0), (3, 4, 2))
    moves = plan_moves(old, align(old, Placement(((1, 2, 5), (0, 3, 4)), 6)))
    assert [m for m in moves if m.src_rank != m.dst_rank or m.src_slot != m.dst_slot] == [
        Move(5, 1, 2, 0, 0), Move(0, 0, 0, 1, 2)]


def test_a_layer_moves_to_its_rebalanced_placement_and_computes_the_same():
    """Skewed routing, two redundant slots: after the move each rank holds exactly the weights of its new
    placement's experts, the placement is EPLB's on the ranks' summed loads, and outputs are unchanged."""
    full, hidden, expected = one_rank(seed=3)

    def body(group):
        ep = ExpertParallel(group, 1, [0], EXPERTS, 2, 8, 8, CPU)
        weights = rank_weights(full, ep.held(0))
        skew = torch.tensor([[0, 1]] * (4 + 4 * group.rank) + [[2, 5]])
        ep.load.add(0, skew)
        ep.sync_load()
        moved = ep.move_layer(0, weights)
        out = ep.moe_block(0, weights, CONFIG, hidden, 9, "cpu")
        return moved, ep.placement(0), ep.held(0), weights, out, ep.stats()

    results = run_ranks(2, body)
    load = [0.0] * EXPERTS
    for e, n in ((0, 13), (1, 13), (2, 2), (5, 2)):
        load[e] = n
    assert results[0][1] == results[1][1]
    assert [sorted(held) for held in results[0][1].slots] == [sorted(held) for held in rebalance(load, 2, 2).slots]
    for moved, _, held, weights, out, stats in results:
        assert moved
        ids = torch.tensor(held)
        assert torch.equal(weights.w13, full.w13[ids]) and torch.equal(weights.w2, full.w2[ids])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert stats["balancedness"][0] > 0.9 and len(stats["move_seconds"]) == 1


def test_a_move_in_parts_runs_on_the_old_placement_until_its_last_part():
    """One expert between ranks per call: the layer keeps its old placement (and outputs) until the last
    part, then holds exactly its new experts; every rank takes the same number of calls."""
    full, hidden, expected = one_rank(seed=5)

    def body(group):
        ep = ExpertParallel(group, 1, [0], EXPERTS, 0, 8, 8, CPU)
        weights = rank_weights(full, ep.held(0))
        ep.load.add(0, torch.tensor([[0, 1], [2, 3], [0, 2]] * (1 + group.rank)))
        ep.sync_load()
        old, calls = ep.placement(0), []
        while not ep.move_layer(0, weights, max_moves=1):
            calls.append(ep.placement(0) == old)
            torch.testing.assert_close(ep.moe_block(0, weights, CONFIG, hidden, 9, "cpu"), expected)
        return calls, ep.placement(0) != old, ep.held(0), weights

    results = run_ranks(2, body)
    assert results[0][0] == results[1][0] and len(results[0][0]) >= 1 and all(results[0][0])
    for _, changed, held, weights in results:
        assert changed and torch.equal(weights.w13, full.w13[torch.tensor(held)])


def test_eplb_schedule_syncs_once_then_moves_a_layer_a_step():
    schedule = EplbSchedule([1, 3], interval_steps=3, load_sync_steps=100)
    ops = [schedule.next_op() for _ in range(8)]
    assert ops == [(False, None), (False, None), (True, 1), (False, 3), (False, None), (True, 1), (False, 3),
                   (False, None)]
    schedule = EplbSchedule([0], interval_steps=0, load_sync_steps=2)
    assert [schedule.next_op() for _ in range(3)] == [(False, None), (True, None), (False, None)]
    schedule.request()
    assert schedule.next_op() == (True, 0)
    schedule.again(0)  # its move went part of the way
    assert [schedule.next_op() for _ in range(2)] == [(False, 0), (True, None)]  # then the periodic sync


def test_experts_held_whole_need_not_divide_the_attention_split():
    config = model_config_from_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                                     "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
                                     "num_key_value_heads": 2, "moe_intermediate_size": 9, "num_experts": 4,
                                     "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="expert intermediate size 9"):
        check_tp(config, 2)
    assert TPShard(1, 2).local_config(config, experts=False).moe.intermediate_size == 9


def test_initial_placement_is_contiguous_and_fills_redundant_slots_evenly():
    assert initial_placement(8, 2, 0).slots == ((0, 1, 2, 3), (4, 5, 6, 7))
    placement = initial_placement(8, 2, 2)
    assert sorted(placement.replica_counts()) == [1] * 6 + [2] * 2
    assert all(len(set(held)) == len(held) for held in placement.slots)


# Whole engines: a worker process per rank.

PROMPT_LENS = (3, 29, 70)
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def prompts(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.integration
@pytest.mark.parametrize("kind, options", [
    ("qwen3_moe", {}),
    ("mixtral", {"tensor_parallel_size": 2}),  # attention split over the expert-parallel ranks
    ("qwen2_moe", {"num_redundant_experts": 2}),  # a shared expert, replicas
    ("qwen3_moe", {"expert_dispatch": "all_to_all", "num_redundant_experts": 2}),
    ("qwen2_moe", {"expert_dispatch": "all_to_all", "tensor_parallel_size": 2}),
])
def test_two_expert_parallel_ranks_match_hf(kind, options, checkpoint, hf_model):
    path = checkpoint(kind)
    model = hf_model(path)
    with LLM(str(path), num_blocks=64, expert_parallel_size=2, max_num_batched_tokens=32, **options) as llm:
        outputs = llm.generate(prompts(), GREEDY)
        ranks = llm.engine.tp_ranks()
    for out, prompt in zip(outputs, prompts()):
        assert_greedy_match(out.token_ids, *hf_greedy(model, prompt, MAX_NEW))
    assert len(ranks) == 2


@pytest.mark.integration
@pytest.mark.parametrize("dispatch", ["all_reduce", "all_to_all"])
def test_a_live_rebalance_mid_generation_keeps_the_tokens(checkpoint, dispatch):
    """Rebalances every 4 steps, an expert a step, while 3 streams decode: the tokens equal one rank's."""
    path = str(checkpoint("qwen3_moe"))
    with LLM(path, num_blocks=64, max_num_batched_tokens=32) as llm:
        expected = [out.token_ids for out in llm.generate(prompts(), GREEDY)]
    with LLM(path, num_blocks=64, max_num_batched_tokens=32, expert_parallel_size=2, num_redundant_experts=2,
             eplb_interval_steps=4, eplb_window_steps=8, expert_dispatch=dispatch) as llm:
        got = [out.token_ids for out in llm.generate(prompts(), GREEDY)]
        stats = llm.engine.experts.stats()
        counters = llm.engine.stats()
    assert got == expected
    assert stats["move_seconds"], "no layer moved"
    assert counters.expert_moves == len(stats["move_seconds"]) and 0 < counters.expert_balancedness <= 1


@pytest.mark.integration
def test_expert_parallel_layouts_that_cannot_run_are_refused(checkpoint):
    with pytest.raises(ValueError, match="has no experts"):
        LLM(str(checkpoint("llama")), num_blocks=16, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"4 experts plus 1 redundant ones \(5\) do not divide over 2"):
        LLM(str(checkpoint("mixtral")), num_blocks=16, expert_parallel_size=2, num_redundant_experts=1)
    with pytest.raises(ValueError, match="tensor_parallel_size 4: attention runs on the expert-parallel ranks"):
        EngineConfig(expert_parallel_size=2, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="needs expert_parallel_size > 1"):
        EngineConfig(num_redundant_experts=2)
    with LLM(str(checkpoint("mixtral")), num_blocks=16) as llm:
        with pytest.raises(ValueError, match="rebalancing experts needs expert_parallel_size > 1"):
            llm.engine.experts.rebalance()
