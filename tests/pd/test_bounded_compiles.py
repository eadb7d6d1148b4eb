"""Nothing compiles while requests run, and the kernel shapes a varied run creates are bounded.

The engine's compiled parts are the ``cpu`` backend's C++ extension, built
when the engine starts, and oneDNN's GEMM kernels, which oneDNN creates and
keeps once per input shape. A varied run (prompts of 1 to 300 tokens, chunked
prefills, decodes of every batch size) must build nothing, and must reach the
GEMMs with no more row counts than ``padded_rows`` allows. The model runs a
batch on those rows from its embedding on, so no dense layer pads (copies) its
input itself.
"""

from __future__ import annotations

import math
import random

import pytest
import torch.utils.cpp_extension

from pd import LLM, SamplingParams
from pd.model import linear
from pd.model.linear import BUCKETS_PER_OCTAVE, EXACT_ROWS


# A varied run of a whole model, about 20 s each: the slow tier's (make test), not the unit tier's.
@pytest.mark.slow
@pytest.mark.parametrize("model", ["builtin:tiny-llama", "qwen2_moe"])
def test_a_varied_run_builds_nothing_and_reaches_few_gemm_shapes(monkeypatch, model, checkpoint):
    """Also an MoE model: its router and shared expert are dense layers, and each expert's GEMMs (the
    fused MoE's GEMM path, past its one-call kernel's slots) take bucketed row counts too."""
    from pd_kernels.cpu import moe

    llm = LLM(model if model.startswith("builtin:") else str(checkpoint(model)), max_num_batched_tokens=256)
    assert llm.engine.runner.backend == "cpu"
    vocab = llm.engine.model_config.vocab_size
    builds = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: builds.append(a) or None)
    rows, inputs = set(), set()
    call = linear.Linear.__call__

    def recording(self, x):
        rows.add(linear.padded_rows(x.shape[0]))
        inputs.add(x.shape[0])
        return call(self, x)

    monkeypatch.setattr(linear.Linear, "__call__", recording)
    experts = []
    gemm = moe._onednn_gemm
    monkeypatch.setattr(moe, "_onednn_gemm", lambda x, w: experts.append(x.shape[0]) or gemm(x, w))
    monkeypatch.setattr(moe, "MAX_SLOTS_PER_EXPERT", 8)  # the GEMM path from 8 slots an expert
    rng = random.Random(0)
    for _ in range(3):
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 300))] for _ in range(rng.randint(1, 24))]
        params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in prompts]
        llm.generate(prompts, params)

    assert builds == []
    largest = max(rows)
    bound = EXACT_ROWS + BUCKETS_PER_OCTAVE * math.ceil(math.log2(max(largest, EXACT_ROWS) / EXACT_ROWS))
    assert len(rows) <= bound
    assert largest <= 256 * 9 // 8  # the step budget, padded
    assert max(inputs) > EXACT_ROWS and inputs <= rows  # batches past 64 rows came already padded
    assert all(linear.padded_rows(n) == n for n in experts)
    assert bool(experts) == (llm.engine.model_config.moe is not None)
