"""Trace requests as token ids, so that the engine's own block hashes see the trace's shared prefixes.

Each trace block id stands for a block and everything before it
(``bench.trace``), so a block's tokens are drawn from a generator seeded by
its id: equal ids give equal tokens, and equal prefixes hash equal in the
engine. ``block_tokens`` scales a trace down (Mooncake's blocks are 512
tokens; a CPU profile of a tiny model wants shorter prompts): every length is
scaled by ``block_tokens / 512``.
"""

from __future__ import annotations

import random

from bench.trace import TRACE_BLOCK_TOKENS, TraceRequest


def scaled(length: int, block_tokens: int) -> int:
    return max(1, round(length * block_tokens / TRACE_BLOCK_TOKENS))


def prompt_token_ids(request: TraceRequest, block_tokens: int, vocab_size: int) -> list[int]:
    """The request's prompt: its blocks' tokens, cut to its (scaled) length."""
    tokens: list[int] = []
    for block_id in request.hash_ids:
        block = random.Random(block_id)
        tokens += [block.randrange(vocab_size) for _ in range(block_tokens)]
    length = scaled(request.input_length, block_tokens)
    if len(tokens) < length:  # a trace whose ids cover less than its length: the rest is its own
        own = random.Random(f"{request.timestamp_ms}:{request.hash_ids}")
        tokens += [own.randrange(vocab_size) for _ in range(length - len(tokens))]
    return tokens[:length]
