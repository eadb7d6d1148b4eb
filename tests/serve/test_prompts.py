"""Prompt encoding at the ingress: bounded before tokenizing, and never on the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from pd.serve.openai_protocol import OpenAIError
from pd.serve.prompts import PromptEncoder


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(resolve_model_path("builtin:tiny-llama"))


def encoder(tokenizer, max_model_len: int) -> PromptEncoder:
    return PromptEncoder(tokenizer, tokenizer.vocab_size, max_model_len, num_threads=1, max_stop_strings=4,
                         max_stop_chars=64)


def test_a_huge_prompt_is_tokenized_while_the_loop_keeps_serving(tokenizer):
    prompts = encoder(tokenizer, max_model_len=10**8)  # no length bound: it must really tokenize 4 MB
    text = "word " * 800_000

    async def run() -> tuple[int, float, float]:
        task = asyncio.create_task(prompts.encode(text))
        started = last = time.monotonic()
        longest = 0.0
        while not task.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            longest, last = max(longest, now - last), now
        return len(await task), longest, last - started

    num_tokens, longest_gap, encode_s = asyncio.run(run())
    assert num_tokens > 100_000
    # Tokenized on the loop, the encode would be one gap as long as itself. Bounded by the encode's own time
    # too, so that a busy host, which slows both, does not fail it (7 s here, under load).
    assert longest_gap < max(0.5, encode_s / 4), (longest_gap, encode_s)


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(tokenizer):
    prompts = encoder(tokenizer, max_model_len=4096)
    bound = 4096 * tokenizer.max_token_chars() * 4
    with pytest.raises(OpenAIError, match="however it is tokenized") as refused:
        asyncio.run(prompts.encode("x" * (bound + 1)))
    assert refused.value.code == "context_length_exceeded"
    # Just under the bound it is tokenized and counted.
    assert len(asyncio.run(prompts.encode("word " * 1000))) > 0
    with pytest.raises(OpenAIError, match="at most 4 are allowed"):
        prompts.check_stop(["a", "b", "c", "d", "e"])
