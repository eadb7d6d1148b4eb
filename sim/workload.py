"""Trace requests as token ids, so that the engine's own block hashes see the trace's shared prefixes.

Each trace block id stands for a block and everything before it
(``bench.trace``), so a block's tokens are drawn from a generator seeded by
its id: equal ids give equal tokens, and equal prefixes hash equal in the
engine. ``block_tokens`` scales a trace down (Mooncake's blocks are 512
tokens; a CPU profile of a tiny model wants shorter prompts): every length is
scaled by ``block_tokens / 512``.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Sequence

import numpy as np

from bench.trace import TRACE_BLOCK_TOKENS, TraceRequest
from pd.sampling_params import SamplingParams


def scaled(length: int, block_tokens: int) -> int:
    return max(1, round(length * block_tokens / TRACE_BLOCK_TOKENS))


@functools.lru_cache(maxsize=1 << 16)
def block_token_ids(block_id: int, block_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """One trace block's tokens: the same for the same id (cached: shared prefixes repeat their blocks)."""
    return tuple(np.random.default_rng(block_id).integers(0, vocab_size, block_tokens).tolist())


def prompt_token_ids(request: TraceRequest, block_tokens: int, vocab_size: int) -> list[int]:
    """The request's prompt: its blocks' tokens, cut to its (scaled) length."""
    tokens: list[int] = []
    for block_id in request.hash_ids:
        tokens += block_token_ids(block_id, block_tokens, vocab_size)
    length = scaled(request.input_length, block_tokens)
    if len(tokens) < length:  # a trace whose ids cover less than its length: the rest is its own
        own = random.Random(f"{request.timestamp_ms}:{request.hash_ids}")
        tokens += [own.randrange(vocab_size) for _ in range(length - len(tokens))]
    return tokens[:length]


def submit_trace(cluster, trace: Sequence[TraceRequest], time_scale: float = 1.0, until_s: float = math.inf) -> int:
    """Have ``cluster`` (a ``SimCluster``) receive ``trace``: request ``i`` as ``r{i}``, ``time_scale`` times faster.

    Requests arriving after ``until_s`` are left out; returns how many are in.
    Outputs run to the trace's length (``ignore_eos``); prompts are the
    trace's own 512-token blocks (``prompt_token_ids``).
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
            cluster.submit(f"r{index}", prompt_token_ids(request, TRACE_BLOCK_TOKENS, vocab_size), params)

        loop.at(arrival_s, arrive)
    return count
