"""What an engine reports to the routers of its queue (``pd.engine.reports.load_shape``): a waiting request
counts the prompt after the prefix its admission will find cached, not its whole prompt."""

from __future__ import annotations

from pd import LLM, SamplingParams
from pd.engine.reports import load_shape
from router.step_cost import prefill_pairs

BLOCK = 16  # the engine's default block size
HISTORY = [(7 * i) % 200 + 3 for i in range(8 * BLOCK)]  # a session's 128 tokens, 8 full blocks
TURN = HISTORY + [(11 * i) % 200 + 5 for i in range(40)]  # its next turn: the history and 40 new tokens


def test_a_waiting_turn_counts_the_tokens_after_its_cached_history():
    """The history ran, so its 8 blocks are cached; the next turn, queued but not admitted, is reported as
    its 40 new tokens after 128 computed ones, as its admission will compute it. A request scoring its prompt
    computes all of it and counts whole; so does a prompt nothing of which is cached."""
    llm = LLM("builtin:tiny-llama", num_blocks=64)
    llm.generate([HISTORY], SamplingParams(max_tokens=1))
    engine = llm.engine
    engine.add_request("turn", TURN, SamplingParams(max_tokens=1))
    assert load_shape(engine.scheduler) == (40, prefill_pairs(40, 128), 0, 0)

    engine.add_request("scored", TURN, SamplingParams(max_tokens=1, prompt_logprobs=1))
    cold = [(13 * i) % 200 + 1 for i in range(50)]
    engine.add_request("cold", cold, SamplingParams(max_tokens=1))
    tokens, pairs, _, _ = load_shape(engine.scheduler)
    assert tokens == 40 + len(TURN) + 50
    assert pairs == prefill_pairs(40, 128) + prefill_pairs(len(TURN), 0) + prefill_pairs(50, 0)
