"""Turning a request's prompt into token ids, bounded, and off the ingress's event loop.

Tokenizing is the one piece of ingress work whose cost a client picks, so:
- a prompt whose length in characters alone proves it over ``max_model_len``
  is refused before any tokenizing;
- the rest is tokenized (and chat templates rendered) on a small thread pool
  (the tokenizer releases the GIL), so one huge prompt never stalls ``/health``
  or another client's stream.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pd.model.tokenizer import Tokenizer
from pd.sampling_params import SamplingParams
from pd.serve.openai_protocol import OpenAIError

# A normalizer may shrink text before tokenizing (composing characters, say);
# the character bound allows for it this many times over.
NORMALIZATION_SLACK = 4


class PromptEncoder:
    """The ingress's tokenizer, its bounds, and the threads it runs on."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, num_threads: int,
                 max_stop_strings: int, max_stop_chars: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_stop_strings = max_stop_strings
        self.max_stop_chars = max_stop_chars
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="pd-tokenize")
        # No prompt of more characters than this can fit: every token spans at most that many.
        self._max_chars = None if tokenizer is None else \
            max_model_len * tokenizer.max_token_chars() * NORMALIZATION_SLACK

    async def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise OpenAIError(400, f"prompt holds token ids outside the vocabulary: {bad[:5]}", param="prompt")
            return list(prompt)
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        self._check_chars(prompt, "prompt")
        return await self.run(self.tokenizer.encode, prompt, add_special_tokens)

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer or chat template", param="messages")
        self._check_chars("".join(m["content"] for m in messages), "messages")
        try:
            text = await self.run(self.tokenizer.apply_chat_template, messages)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        self._check_chars(text, "messages")
        # The template writes BOS itself.
        return await self.run(self.tokenizer.encode, text, False)

    def check_lengths(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise OpenAIError(400, f"prompt has {len(token_ids)} tokens; the limit is {self.max_model_len - 1}",
                              param="prompt", code="context_length_exceeded")
        if params.max_tokens > self.max_model_len:
            raise OpenAIError(400, f"max_tokens {params.max_tokens} exceeds the model length {self.max_model_len}",
                              param="max_tokens")

    def check_stop(self, stop: list[str]) -> list[str]:
        """``stop``, within the configured bounds on its count and total length."""
        if len(stop) > self.max_stop_strings:
            raise OpenAIError(400, f"{len(stop)} stop strings; at most {self.max_stop_strings} are allowed",
                              param="stop")
        total = sum(len(s) for s in stop)
        if total > self.max_stop_chars:
            raise OpenAIError(400, f"the stop strings hold {total} characters; at most {self.max_stop_chars} "
                                   "are allowed", param="stop")
        return stop

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_chars(self, text: str, param: str) -> None:
        if self._max_chars is not None and len(text) > self._max_chars:
            raise OpenAIError(400, f"{param} has {len(text)} characters: more than {self.max_model_len - 1} tokens "
                                   "however it is tokenized", param=param, code="context_length_exceeded")

    async def run(self, fn, *args):
        """``fn(*args)`` on the tokenizer threads: client-controlled work kept off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
