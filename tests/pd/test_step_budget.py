"""Stall-free batching: beside decodes, a prompt chunk is cut to the step's inter-token budget."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pd.engine.step_budget import MIN_FIT_STEPS, StepBudget
from router.step_cost import StepShape, StepSums

# base, per token, per pair, per seq, per sample: a step of 3 decodes after 100 tokens costs
# 1 + 3 * (0.1 + 0.5 + 0.2) + 3 * 101 * 1e-4 = 3.43 ms.
LAW = (1e-3, 1e-4, 1e-7, 5e-4, 2e-4)


def _sums(num_steps: int = 64) -> StepSums:
    sums, rng = StepSums(), random.Random(0)
    for _ in range(num_steps):
        shape = StepShape(num_tokens=rng.randrange(1, 2048), attn_pairs=rng.randrange(1, 10**6),
                          num_seqs=rng.randrange(1, 32), num_samples=rng.randrange(1, 32))
        sums.record(shape, sum(c * x for c, x in zip(LAW, shape.vector())))
    return sums


def _decode(computed: int, priority: int = 0) -> SimpleNamespace:
    return SimpleNamespace(num_tokens_with_unread=computed + 1, num_scheduled_tokens=computed,
                           num_computed_tokens=computed, priority=priority)


# Three decodes after 100 tokens each (``_decode(100)``), priced by LAW.
DECODES_S = LAW[0] + 3 * (LAW[1] + LAW[3] + LAW[4]) + 3 * 101 * LAW[2]


def _chunk_s(n: int, c: int) -> float:
    return LAW[1] * n + LAW[2] * (n * c + n * (n + 1) / 2) + LAW[3] + LAW[4]


def test_a_chunk_beside_decodes_is_the_largest_that_keeps_the_step_within_the_target():
    budget = StepBudget(0.05, _sums(), min_chunk=16)
    budget.begin([_decode(100)] * 3)
    chunk = budget.cap(2048, 0)
    assert 16 < chunk < 2048
    assert DECODES_S + _chunk_s(chunk, 0) <= 0.05 < DECODES_S + _chunk_s(chunk + 1, 0) + 1e-9
    assert budget.cap(2048, 0) == 0  # the step's time is spent: a second prompt waits for the next
    assert budget.cap(1, 500) == 1  # a decode's token is never cut
    spent = StepBudget(0.003, _sums(), min_chunk=16)
    spent.begin([_decode(100)] * 3)  # the decodes alone pass the target
    assert [spent.cap(2048, 0), spent.cap(8, 0), spent.cap(2048, 0)] == [16, 0, 0]  # the first chunk advances


def test_a_step_without_decodes_or_a_target_is_not_limited_and_a_young_fit_limits_to_the_least():
    budget = StepBudget(0.05, _sums(), min_chunk=16)
    budget.begin([SimpleNamespace(num_tokens_with_unread=900, num_scheduled_tokens=0, num_computed_tokens=0)])
    assert budget.cap(2048, 0) == 2048  # only prompts: no stream waits on this step
    off = StepBudget()
    off.begin([_decode(100)])
    assert off.cap(2048, 0) == 2048
    young = StepBudget(0.05, _sums(MIN_FIT_STEPS - 1), min_chunk=16)
    young.begin([_decode(100)])
    assert young.cap(2048, 0) == 16


def test_a_longer_context_gets_a_smaller_chunk():
    chunks = []
    for computed in (0, 20_000):
        budget = StepBudget(0.05, _sums(), min_chunk=16)
        budget.begin([_decode(100)])
        chunks.append(budget.cap(4096, computed))
    assert chunks[1] < chunks[0]


def test_a_chunk_that_scores_its_prompt_pays_a_logits_row_per_token():
    """``echo`` with ``logprobs`` and ``prompt_logprobs`` compute the LM head (and its top k) at every prompt
    position: priced as a plain chunk, such a chunk beside streams overran the step by that much."""
    chunks = {}
    for scored in (False, True):
        budget = StepBudget(0.05, _sums(), min_chunk=16)
        budget.begin([_decode(100)] * 3)
        chunks[scored] = budget.cap(2048, 0, scored)
    n = chunks[True]
    assert 16 < n < chunks[False]
    assert DECODES_S + _chunk_s(n, 0) + LAW[4] * n <= 0.05 < DECODES_S + _chunk_s(n + 1, 0) + LAW[4] * (n + 1) + 1e-9


def test_the_step_shape_counts_a_scored_prompts_rows_as_logits_rows():
    from pd import SamplingParams
    from pd.engine.outputs import ScheduledRequest
    from pd.engine.request import Request

    plain = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    scored = Request("b", list(range(10)), SamplingParams(max_tokens=4, prompt_logprobs=2))
    scored.num_computed_tokens = 4  # the chunk computes positions 4-9; positions 4-8 score tokens 5-9
    shape = StepShape.of([ScheduledRequest(plain, 6, False), ScheduledRequest(scored, 6, True)])
    assert shape.num_samples == 5 + 1 and shape.num_tokens == 12


def test_a_step_of_less_urgent_prompts_is_cut_to_its_target_and_one_of_urgent_ones_is_not():
    """With ``low_priority_s``, a step whose first prompt chunk is of priority > 0 keeps within that time, decodes
    or not: an urgent prompt arriving meanwhile waits for it. A step led by an urgent prompt is not cut."""
    prompts = [SimpleNamespace(num_tokens_with_unread=900, num_scheduled_tokens=0, num_computed_tokens=0)]
    batch = StepBudget(sums=_sums(), min_chunk=16, low_priority_s=0.05)
    batch.begin(prompts)
    chunk = batch.cap(2048, 0, priority=1)
    assert LAW[0] + _chunk_s(chunk, 0) <= 0.05 < LAW[0] + _chunk_s(chunk + 1, 0) + 1e-9
    assert batch.cap(2048, 0, priority=1) == 0  # the step's time is spent
    urgent = StepBudget(sums=_sums(), min_chunk=16, low_priority_s=0.05)
    urgent.begin(prompts)
    assert [urgent.cap(2048, 0, priority=0), urgent.cap(2048, 0, priority=1)] == [2048, 2048]
    both = StepBudget(0.2, _sums(), min_chunk=16, low_priority_s=0.05)  # beside decodes, the tighter target
    both.begin([_decode(100)] * 3)
    chunk = both.cap(2048, 0, priority=1)
    assert DECODES_S + _chunk_s(chunk, 0) <= 0.05 < DECODES_S + _chunk_s(chunk + 1, 0) + 1e-9
    sums = _sums(MIN_FIT_STEPS - 1)
    young = StepBudget(sums=sums, min_chunk=16, low_priority_s=0.05)
    young.begin(prompts)
    per_token = sums.moments[0] / sums.gram[1]  # no fit yet: the steps' seconds per token
    assert young.cap(2048, 0, priority=1) == max(16, int(0.05 / per_token))
    assert young.cap(2048, 0, priority=1) == 0
    new = StepBudget(sums=StepSums(), min_chunk=16, low_priority_s=0.05)
    new.begin(prompts)
    assert new.cap(2048, 0, priority=1) == 2048  # no step yet: not limited


def test_a_prompt_more_urgent_than_every_stream_is_not_cut_for_them_and_one_as_urgent_as_one_is():
    """The inter-token target protects the streams at least as urgent as the prompt: a batch job's stream never
    holds an urgent prompt's first token back; an urgent stream holds back a prompt of any band."""
    batch_streams = StepBudget(0.01, _sums(), min_chunk=16)
    batch_streams.begin([_decode(100, priority=1)] * 3)
    assert [batch_streams.cap(2048, 0, priority=0), batch_streams.cap(2048, 0, priority=0)] == [2048, 2048]
    for streams, prompt in (([1, 1, 0], 0), ([1, 1, 1], 1), ([2, 2, 1], 1)):
        budget = StepBudget(0.01, _sums(), min_chunk=16)
        budget.begin([_decode(100, priority=p) for p in streams])
        chunk = budget.cap(2048, 0, priority=prompt)
        assert DECODES_S + _chunk_s(chunk, 0) <= 0.01 < DECODES_S + _chunk_s(chunk + 1, 0) + 1e-9, (streams, prompt)
    low = StepBudget(0.2, _sums(), min_chunk=16, low_priority_s=0.01)  # the batch band's bound still holds
    low.begin([_decode(100, priority=2)] * 3)
    chunk = low.cap(2048, 0, priority=1)
    assert DECODES_S + _chunk_s(chunk, 0) <= 0.01 < DECODES_S + _chunk_s(chunk + 1, 0) + 1e-9


@pytest.mark.parametrize("name", ["itl_target_s", "low_priority_step_s"])
@pytest.mark.parametrize("target", [0.0, -1.0])
def test_a_target_that_is_not_positive_is_refused(name, target):
    from pd.config import EngineConfig

    with pytest.raises(ValueError, match=name):
        EngineConfig(model="builtin:tiny-llama", **{name: target})


def _prompt_chunks(engine) -> list[tuple[str, int]]:
    """``(request id, tokens)`` of every prompt chunk (over one token) ``engine`` schedules from now on."""
    schedule, seen = engine.scheduler.schedule, []

    def spy():
        out = schedule()
        seen.extend((item.request.request_id, item.num_new_tokens) for item in out.scheduled if item.num_new_tokens > 1)
        return out

    engine.scheduler.schedule = spy
    return seen


def _three_streams(engine, priority: int = 0) -> None:
    """Three streams decoding, and the engine's step fit with its steps."""
    from pd import SamplingParams

    for i in range(3):
        engine.add_request(f"s{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                           priority=priority)
    for _ in range(MIN_FIT_STEPS + 2):
        engine.step()


def test_an_engine_chunks_a_prompt_beside_streams_and_its_tokens_are_unchanged():
    from pd import SamplingParams
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    long_prompt = [3 + i % 900 for i in range(1200)]
    chunks, tokens = {}, {}
    for target in (None, 1e-6):  # a target no chunk meets: beside the streams, every chunk is the least
        engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=512, itl_target_s=target))
        seen = _prompt_chunks(engine)
        _three_streams(engine)
        engine.add_request("long", long_prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.close()
        chunks[target], tokens[target] = [n for rid, n in seen if rid == "long"], got
    assert chunks[None] == [1200]  # one chunk of the whole prompt beside the streams
    block = 16
    assert chunks[1e-6][0] == block and set(chunks[1e-6][:20]) == {block}  # while the streams run
    assert sum(chunks[1e-6]) == 1200
    assert tokens[1e-6] == tokens[None]


def test_an_engine_cuts_a_batch_prompts_steps_and_not_an_urgent_ones():
    """With ``low_priority_step_s``, once the engine's fit has its steps, a prompt of priority 1 computes in chunks
    the target allows (a target no chunk meets: a block each), one of priority 0 in one chunk."""
    from pd import SamplingParams
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=512, low_priority_step_s=1e-6))
    seen = _prompt_chunks(engine)
    for i in range(MIN_FIT_STEPS + 2):  # the fit has its steps
        engine.add_request(f"w{i}", [5 + i, 6, 7, 8], params)
        engine.step()
    for name, priority, first in (("batch", 1, 3), ("urgent", 0, 400)):  # prompts with no prefix in common
        engine.add_request(name, [first + i % 300 for i in range(600)], params, priority=priority)
        while engine.has_unfinished_requests():
            engine.step()
    engine.close()
    chunks = {name: [n for rid, n in seen if rid == name] for name in ("batch", "urgent")}
    assert chunks["batch"] == [16] * 37 + [8]
    assert chunks["urgent"] == [600]


def test_an_engine_computes_an_urgent_prompt_in_one_chunk_beside_batch_streams():
    """Beside streams of priority 1 only, a prompt of priority 0 is not cut to their inter-token target (a target
    no chunk meets); beside one stream of priority 0 it is (``test_an_engine_chunks_a_prompt_beside_streams...``)."""
    from pd import SamplingParams
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=512, itl_target_s=1e-6))
    seen = _prompt_chunks(engine)
    _three_streams(engine, priority=1)
    engine.add_request("urgent", [3 + i % 900 for i in range(1200)],
                       SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), priority=0)
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    assert [n for rid, n in seen if rid == "urgent"] == [1200]
