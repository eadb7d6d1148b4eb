"""A trace handed to a simulated cluster as token-id requests.

Prompts come from ``pd.workload.token_prompts.trace_prompt_token_ids``: equal
trace block ids give equal tokens, so the engine's own block hashes see the
trace's shared prefixes.
"""

from __future__ import annotations

import math
from typing import Sequence

from pd.sampling_params import SamplingParams
from pd.workload.token_prompts import trace_prompt_token_ids
from pd.workload.trace import TRACE_BLOCK_TOKENS, TraceRequest


def submit_trace(cluster, trace: Sequence[TraceRequest], time_scale: float = 1.0, until_s: float = math.inf) -> int:
    """Have ``cluster`` (a ``SimCluster``) receive ``trace``: request ``i`` as ``r{i}``, ``time_scale`` times faster.

    Requests arriving after ``until_s`` are left out; returns how many are in.
    Outputs run to the trace's length (``ignore_eos``); prompts are the
    trace's own 512-token blocks (``trace_prompt_token_ids``).
    """
    loop = cluster.loop
    vocab_size = next(iter(cluster.decode.replicas.values())).engine.model_config.vocab_size
    count = 0
    for index, request in enumerate(trace):
        arrival_s = request.timestamp_ms / 1000 / time_scale
        if arrival_s > until_s:
            break
        count += 1

        def arrive(index=index, request=request):
            params = SamplingParams(max_tokens=max(1, request.output_length), ignore_eos=True)
            cluster.submit(f"r{index}", trace_prompt_token_ids(request, TRACE_BLOCK_TOKENS, vocab_size), params)

        loop.at(arrival_s, arrive)
    return count
