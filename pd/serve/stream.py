"""One request's output as the ingress streams it: its events, text and latency metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.engine.request import FinishReason
from pd.serve.metrics import RequestMetrics
from pd.serve.openai_protocol import OpenAIError
from pd.serve.text import TextDelta, TextStream
from pd.serve.timeline import Timeline


@dataclass(frozen=True)
class GenerationEvent:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None  # "stop" or "length" on the last event
    num_prompt_tokens: int
    num_output_tokens: int
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per token, when asked for
    prompt_logprobs: list[PromptLogprob] | None = None  # once, with the first token, when asked for
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served where the prompt ran


class StreamTracker:
    """One request's output: incremental text with stop strings, its latency metrics and its timeline."""

    def __init__(self, metrics: RequestMetrics, text: TextStream, num_prompt_tokens: int,
                 timeline: Timeline | None = None):
        self.metrics = metrics
        self.timeline = timeline if timeline is not None else Timeline("")
        self.text = text
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.token_ids: list[int] = []  # every token streamed so far
        self.started = self.last_token_at = time.monotonic()
        self.first_token_at: float | None = None
        self.num_cached_tokens = 0  # set by whoever learns where the prompt ran

    def add(self, token_ids: list[int], logprobs: list[float], reason: FinishReason | None, *,
            top_logprobs=(), prompt_logprobs=None) -> GenerationEvent:
        """The event for new tokens; ``reason`` is the engine's. A stop string may end the request first."""
        now = time.monotonic()
        if self.first_token_at is None:
            if token_ids:
                self.metrics.ttft.observe(now - self.started)
                self.first_token_at = now
                if "ttft_s" not in self.timeline.attributes:  # the first of its choices
                    self.timeline.set(ttft_s=round(self.timeline.now_s(), 6))
        elif token_ids:
            self.metrics.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        if len(token_ids) > 1 and self.text.has_stops:  # a verify step's tokens: a stop string may end them early
            delta, token_ids, logprobs, top_logprobs = self._add_until_stop(token_ids, logprobs, top_logprobs)
        else:
            delta = self.text.add(token_ids)
        self.num_output_tokens += len(token_ids)
        self.token_ids += token_ids
        text = delta.text
        if delta.stopped:
            out_reason = "stop"
        elif reason is not None:
            out_reason = "stop" if reason is FinishReason.STOP else "length"
            text += self.text.finish().text
        else:
            out_reason = None
        if out_reason is not None:
            self.metrics.e2e.observe(now - self.started)
            if self.first_token_at is not None:
                self.metrics.decode.observe(now - self.first_token_at)
        return GenerationEvent(token_ids, text, logprobs, out_reason, self.num_prompt_tokens, self.num_output_tokens,
                               list(top_logprobs), None if prompt_logprobs is None else list(prompt_logprobs),
                               self.num_cached_tokens)

    def _add_until_stop(self, token_ids: list[int], logprobs: list[float], top_logprobs):
        """Several tokens at once (speculative decoding), one at a time through the stop strings: those after
        the one that completes a stop string are not output, as they would not have been generated."""
        texts = []
        for index, token_id in enumerate(token_ids):
            delta = self.text.add([token_id])
            texts.append(delta.text)
            if delta.stopped:
                kept = index + 1
                return (TextDelta("".join(texts), True), token_ids[:kept], logprobs[:kept],
                        list(top_logprobs)[:kept])
        return TextDelta("".join(texts), False), token_ids, logprobs, top_logprobs


async def with_deadline(events: AsyncIterator[GenerationEvent], timeout_s: float) -> AsyncIterator[GenerationEvent]:
    """``events`` until ``timeout_s`` has passed; then they are closed (cancelling the pools' work)."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise OpenAIError(504, f"request timed out after {timeout_s:g} s", type="timeout_error",
                                  code="request_timeout") from None
            yield event
    finally:
        await events.aclose()
