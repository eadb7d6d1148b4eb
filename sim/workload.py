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
import random

import numpy as np

from bench.trace import TRACE_BLOCK_TOKENS, TraceRequest


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
