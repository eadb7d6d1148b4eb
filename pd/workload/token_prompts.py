"""Prompts as token ids, for runs that drive an engine directly (no tokenizer, no HTTP).

Two generators, both seeded and deterministic:

- ``token_batch``: the engine benchmark's cases (``single``, ``uniform``,
  ``mixed``): random prompts with their output lengths, all arriving at once.
- ``trace_prompt_token_ids``: a Mooncake trace request's prompt. Each trace
  block id stands for a block and everything before it (``pd.workload.trace``),
  so a block's tokens are drawn from a generator seeded by its id: equal ids
  give equal tokens, and equal prefixes hash equal in the engine.
  ``block_tokens`` scales a trace down (Mooncake's blocks are 512 tokens; a CPU
  profile of a tiny model wants shorter prompts): every length is scaled by
  ``block_tokens / 512``.

``pd.workload.workloads.TraceWorkload`` is the HTTP load test's replay of a
trace; it draws its blocks from another seed, so its prompts differ from these
(each run's figures stay comparable with its own history).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np

from pd.workload.trace import TRACE_BLOCK_TOKENS, TraceRequest

BATCH_CASES = ("single", "uniform", "mixed")


@dataclass(frozen=True)
class TokenBatch:
    """Prompts (token ids) and each one's output length, ``max_tokens[i]`` for ``prompts[i]``."""

    prompts: list[list[int]]
    max_tokens: list[int]


def token_batch(case: str, vocab: int, seed: int) -> TokenBatch:
    """One of ``BATCH_CASES``: one 128-token prompt, 32 alike, or 64 of mixed lengths (any other name: mixed)."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    if case == "single":
        return TokenBatch([prompt(128)], [128])
    if case == "uniform":
        return TokenBatch([prompt(128) for _ in range(32)], [64] * 32)
    lens = [rng.randint(16, 512) for _ in range(64)]
    return TokenBatch([prompt(n) for n in lens], [rng.randint(8, 128) for _ in range(64)])


def scaled(length: int, block_tokens: int) -> int:
    """``length`` trace tokens in blocks of ``block_tokens`` instead of 512; at least 1."""
    return max(1, round(length * block_tokens / TRACE_BLOCK_TOKENS))


@functools.lru_cache(maxsize=1 << 16)
def block_token_ids(block_id: int, block_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """One trace block's tokens: the same for the same id (cached: shared prefixes repeat their blocks)."""
    return tuple(np.random.default_rng(block_id).integers(0, vocab_size, block_tokens).tolist())


def trace_prompt_token_ids(request: TraceRequest, block_tokens: int, vocab_size: int) -> list[int]:
    """The request's prompt: its blocks' tokens, cut to its (scaled) length."""
    tokens: list[int] = []
    for block_id in request.hash_ids:
        tokens += block_token_ids(block_id, block_tokens, vocab_size)
    length = scaled(request.input_length, block_tokens)
    if len(tokens) < length:  # a trace whose ids cover less than its length: the rest is its own
        own = random.Random(f"{request.timestamp_ms}:{request.hash_ids}")
        tokens += [own.randrange(vocab_size) for _ in range(length - len(tokens))]
    return tokens[:length]
