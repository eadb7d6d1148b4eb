"""A step of few tokens computes on ``decode_threads``; a larger one on ``num_threads``."""

from __future__ import annotations

import pytest
import torch

from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.engine.model_runner import DECODE_STEP_TOKENS
from pd.model.llama import CausalLM


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_decode_steps_take_decode_threads_and_prefill_steps_the_engines(monkeypatch, threads_restored):
    llm = LLM("builtin:tiny-llama", num_blocks=32, num_threads=2, decode_threads=1)
    seen = []
    forward = CausalLM.forward

    def recording(self, token_ids, *args):
        seen.append((token_ids.shape[0], torch.get_num_threads()))
        return forward(self, token_ids, *args)

    monkeypatch.setattr(CausalLM, "forward", recording)
    prompt = list(range(3, 3 + 4 * DECODE_STEP_TOKENS))
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert seen[0] == (len(prompt), 2)
    assert seen[1:] == [(1, 1)] * 3
    assert torch.get_num_threads() == 2


def test_decode_threads_are_checked():
    with pytest.raises(ValueError, match="decode_threads"):
        EngineConfig(decode_threads=0)
