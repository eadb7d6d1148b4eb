"""vLLM's ``priority`` in the scheduler: the most urgent waiting request is admitted first, a step's budget
goes to the most urgent running ones, and KV pressure preempts the least urgent; one priority changes
nothing."""

from __future__ import annotations

import threading

import pytest

from pd import LLM, SamplingParams
from pd.config import SchedulerConfig
from pd.engine.block_pool import BlockPool
from pd.engine.outputs import ForwardOutput
from pd.engine.request import Request
from pd.engine.scheduler import make_scheduler


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64):
    config = SchedulerConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget,
                             max_num_seqs=max_num_seqs, max_model_len=64)
    return make_scheduler(config, BlockPool(num_blocks))


def request(name: str, priority: int, prompt_len: int = 8) -> Request:
    first = 100 * (sum(map(ord, name)) % 50)  # a prompt of its own: no prefix hit on another's
    return Request(name, list(range(first, first + prompt_len)), SamplingParams(max_tokens=8, ignore_eos=True),
                   priority=priority)


def step(sched) -> list[str]:
    """One step: its scheduled requests' ids, each sampling token 7 where it samples."""
    out = sched.schedule()
    sched.launched(out)
    samples = [item for item in out.scheduled if item.samples]
    sched.update(out, ForwardOutput(sampled_token_ids=[7] * len(samples), logprobs=None))
    return [item.request.request_id for item in out.scheduled]


def test_the_most_urgent_waiting_request_is_admitted_first_and_equals_keep_their_order():
    sched = scheduler(max_num_seqs=2)
    for name, priority in (("late", 5), ("a", 0), ("mid", 3), ("b", 0)):
        sched.add(request(name, priority))
    assert step(sched) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["mid", "late"]


def test_the_budget_goes_to_the_most_urgent_running_requests():
    sched = scheduler(budget=8)
    sched.add(request("batch", 9, prompt_len=16))
    assert step(sched) == ["batch"]  # half its prompt
    sched.add(request("urgent", 0, prompt_len=8))
    assert step(sched) == ["urgent"]  # it takes the whole budget ahead of the batch job's chunk


def test_no_less_urgent_prompt_chunk_shares_a_step_with_an_urgent_prompt():
    sched = scheduler(budget=64)
    sched.add(request("batch", 9, prompt_len=48))
    sched.add(request("batch-2", 9, prompt_len=8))
    assert step(sched) == ["batch", "batch-2"]  # one priority: the budget is shared as always
    sched = scheduler(budget=32)
    sched.add(request("batch", 9, prompt_len=60))
    assert step(sched) == ["batch"]  # half its prompt
    sched.add(request("urgent", 0, prompt_len=8))
    sched.add(request("later", 9, prompt_len=8))
    # The urgent prompt's step carries no batch chunk (a step's time grows with its tokens), and admits no
    # less urgent prompt; the batch job's prompt goes on once the urgent one decodes.
    assert step(sched) == ["urgent"]
    assert step(sched) == ["urgent", "batch", "later"]
    sched = scheduler(budget=64)  # nothing running: prompts waiting together are admitted by the same rule
    for name, priority in (("batch", 9), ("urgent", 0), ("urgent-2", 0), ("later", 9)):
        sched.add(request(name, priority))
    assert step(sched) == ["urgent", "urgent-2"]
    assert step(sched) == ["urgent", "urgent-2", "batch", "later"]


def test_kv_pressure_preempts_the_least_urgent_even_when_it_is_the_older():
    sched = scheduler(num_blocks=4)  # two prompts of two blocks each fill it
    sched.add(request("batch", 5))
    assert step(sched) == ["batch"]
    sched.add(request("urgent", 0))
    # The urgent prompt is admitted ahead of the batch job, whose next token then needs a fifth block: the
    # batch job, the older, gives its blocks up and waits at the head of its priority.
    assert step(sched) == ["urgent"]
    assert [r.request_id for r in sched.waiting] == ["batch"] and sched.waiting[0].num_preemptions == 1
    assert step(sched) == ["urgent"]
    assert sched.running[0].num_preemptions == 0


def test_an_urgent_request_that_finds_no_blocks_preempts_the_least_urgent_rather_than_spinning():
    sched = scheduler(num_blocks=4)
    sched.add(request("batch", 5, prompt_len=11))  # three of the four blocks, room for its next token
    assert step(sched) == ["batch"]
    sched.add(request("mid", 3, prompt_len=4))  # the fourth
    assert step(sched) == ["mid", "batch"]
    sched.add(request("urgent", 0, prompt_len=8))  # two blocks, none free
    steps: list[list[str]] = []
    worker = threading.Thread(target=lambda: steps.append(step(sched)), daemon=True)
    worker.start()
    worker.join(10)  # the scheduler once looped here for ever, retrying an admission that could not fit
    assert steps == [["urgent", "mid"]]
    assert [r.request_id for r in sched.waiting] == ["batch"] and sched.waiting[0].num_preemptions == 1


def test_priorities_are_checked_and_one_priority_changes_nothing(checkpoint):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4, 4, 4, 4]]
    params = SamplingParams(max_tokens=6, temperature=0)
    with LLM(str(checkpoint("llama")), num_blocks=64, max_num_seqs=2) as llm:
        plain = llm.generate(prompts, params)
        urgent_last = llm.generate(prompts, params, priority=[3, 3, 0])
        assert [o.token_ids for o in urgent_last] == [o.token_ids for o in plain]
        with pytest.raises(ValueError, match="priority must be an integer"):
            llm.generate(prompts, params, priority=[0, 1.5, 0])
        with pytest.raises(ValueError, match="got 1 priorities for 3 prompts"):
            llm.generate(prompts, params, priority=[0])
