"""The model runs the Triton kernels: same greedy tokens as the torch reference.

Under ``TRITON_INTERPRET=1`` (set in conftest) on CPU. The small token budget
makes steps mix prefill chunks with decodes, and a repeated prompt adds a
prefix-cache hit, so every kind of attention batch goes through the kernels.
"""

from __future__ import annotations

import pytest

from pd import LLM, SamplingParams

PROMPTS = [list(range(3, 8)), list(range(100, 140)), list(range(200, 290)), list(range(100, 140)) + [7, 8]]


@pytest.mark.slow  # the whole model in the Triton interpreter, a minute of CPU (each kernel: test_triton_attention)
def test_builtin_model_same_greedy_tokens_with_triton_and_torch(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "pd-cache"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM("builtin:tiny-llama", num_blocks=64, max_num_batched_tokens=48, attention_backend=backend)
        assert llm.engine.runner.backend == backend
        outputs[backend] = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs["triton"]] == [o.token_ids for o in outputs["torch"]]
    assert outputs["triton"][3].num_cached_tokens == 32


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend"):
        LLM("builtin:tiny-llama", attention_backend="cuda-magic")
