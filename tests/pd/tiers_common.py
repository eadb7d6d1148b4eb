"""Prompts and helpers shared by the KV tier tests: a prompt, and churn that pushes it out of device and host."""

from __future__ import annotations

import random

from pd import LLM, SamplingParams
from router.hashing import hash_block_tokens

DEVICE_BLOCKS, HOST_BLOCKS = 24, 8
PARAMS = SamplingParams(max_tokens=6, temperature=0)
rng = random.Random(0)
FIRST = [rng.randrange(100, 1000) for _ in range(130)]  # 8 full blocks of 16
CHURN = [[rng.randrange(100, 1000) for _ in range(120)] for _ in range(6)]  # pushes FIRST out of device and host
FIRST_HASHES = hash_block_tokens(FIRST, 16)


def served(llm: LLM) -> tuple[list[int], int]:
    before = llm.engine.stats().num_prefix_hit_tokens
    [out] = llm.generate([FIRST], PARAMS)
    return out.token_ids, llm.engine.stats().num_prefix_hit_tokens - before
