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

import torch.utils.cpp_extension

from pd import LLM, SamplingParams
from pd.model import linear
from pd.model.linear import BUCKETS_PER_OCTAVE, EXACT_ROWS


def test_a_varied_run_builds_nothing_and_reaches_few_gemm_shapes(monkeypatch):
    llm = LLM("builtin:tiny-llama", max_num_batched_tokens=256)
    assert llm.engine.runner.backend == "cpu"
    builds = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: builds.append(a) or None)
    rows, inputs = set(), set()
    call = linear.Linear.__call__

    def recording(self, x):
        rows.add(linear.padded_rows(x.shape[0]))
        inputs.add(x.shape[0])
        return call(self, x)

    monkeypatch.setattr(linear.Linear, "__call__", recording)
    rng = random.Random(0)
    for _ in range(3):
        prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 300))] for _ in range(rng.randint(1, 24))]
        params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in prompts]
        llm.generate(prompts, params)

    assert builds == []
    largest = max(rows)
    bound = EXACT_ROWS + BUCKETS_PER_OCTAVE * math.ceil(math.log2(max(largest, EXACT_ROWS) / EXACT_ROWS))
    assert len(rows) <= bound
    assert largest <= 256 * 9 // 8  # the step budget, padded
    assert max(inputs) > EXACT_ROWS and inputs <= rows  # batches past 64 rows came already padded
