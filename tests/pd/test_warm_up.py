"""The warm-up step a replica runs before Serve counts it started: it runs the model and leaves no trace."""

from __future__ import annotations

import pytest

from pd import LLM, SamplingParams

PROMPT = list(range(5, 45))
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("block_size", [4, 16])
def test_warm_up_steps_the_model_and_a_request_after_it_sees_a_fresh_engine(block_size, monkeypatch):
    [expected] = LLM("builtin:tiny-llama", num_blocks=16, block_size=block_size).generate([PROMPT], PARAMS)
    llm = LLM("builtin:tiny-llama", num_blocks=16, block_size=block_size)
    steps = []
    forward = llm.engine.runner._forward
    monkeypatch.setattr(llm.engine.runner, "_forward",
                        lambda batch: steps.append(len(batch.token_ids)) or forward(batch))
    before = llm.engine.stats()
    llm.engine.warm_up()
    assert steps == [16, 1]  # a prefill past the few-row kernel's rows, then a decode step
    assert llm.engine.stats() == before  # no request, no block, no counter
    [out] = llm.generate([PROMPT], PARAMS)
    assert out.token_ids == expected.token_ids
