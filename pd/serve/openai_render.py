"""OpenAI response shapes from generation events: choices, deltas, log-probabilities, tool calls.

One renderer per endpoint. ``delta`` renders a streamed event of one choice;
``choice`` renders a whole choice from its ``ChoiceOutput``. Both have the
tokenizer's one-token text (``token_text``) for log-probability entries.
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.serve.generation import GenerationEvent
from pd.serve.tools import ToolCallMode


@dataclass
class ChoiceOutput:
    """Everything one choice streamed, merged."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, event: GenerationEvent) -> None:
        self.text += event.text
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.top_logprobs += event.top_logprobs
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason = event.finish_reason or self.finish_reason
        self.num_output_tokens = event.num_output_tokens
        self.num_cached_tokens = event.num_cached_tokens


class CompletionRenderer:
    """``/v1/completions``: text choices, legacy log-probabilities, ``echo``.

    ``logprobs_k`` is the request's ``logprobs`` (None: none). With ``echo``
    the prompt's text (and its scores, with ``logprobs``) comes first; with
    ``max_tokens=0`` (``generate=False``) nothing else does.
    ``prompt_logprobs_k`` is vLLM's ``prompt_logprobs`` (None: none): each
    choice then carries ``prompt_logprobs`` as vLLM renders it (this module's ``prompt_logprobs``).
    """

    def __init__(self, token_text: Callable[[int], str], logprobs_k: int | None, prompt_token_ids: list[int],
                 echo_text: str | None, generate: bool, prompt_logprobs_k: int | None = None):
        self.token_text = functools.lru_cache(maxsize=None)(token_text)  # a prompt's top-k repeat their tokens
        self.logprobs_k = logprobs_k
        self.prompt_logprobs_k = prompt_logprobs_k
        self.prompt_token_ids = prompt_token_ids
        self.echo_text = echo_text
        self.generate = generate
        self._echoed: set[int] = set()

    def delta(self, index: int, event: GenerationEvent) -> dict:
        out = ChoiceOutput()
        out.add(event)
        first = index not in self._echoed
        self._echoed.add(index)
        return self._render(index, out, echo=first, reason=event.finish_reason)

    def choice(self, index: int, out: ChoiceOutput) -> dict:
        return self._render(index, out, echo=True, reason=out.finish_reason)

    def _render(self, index: int, out: ChoiceOutput, echo: bool, reason: str | None) -> dict:
        echo = echo and self.echo_text is not None
        text = (self.echo_text if echo else "") + (out.text if self.generate else "")
        if not self.generate:
            reason = "length" if reason is not None else None
        logprobs = None
        if self.logprobs_k is not None:
            logprobs = self._logprobs(out, echo)
        rendered = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if self.prompt_logprobs_k is not None:
            rendered["prompt_logprobs"] = prompt_logprobs(self.prompt_token_ids, out.prompt_logprobs or [],
                                                          self.prompt_logprobs_k, self.token_text)
        return rendered

    def _logprobs(self, out: ChoiceOutput, echo: bool) -> dict:
        tokens, values, tops = [], [], []
        if echo:
            scores = out.prompt_logprobs or []
            tokens = [self.token_text(t) for t in self.prompt_token_ids]
            values = [None] + [s.logprob for s in scores]
            tops = [None] + [self._top(s.top) for s in scores]
        if self.generate:
            tokens += [self.token_text(t) for t in out.token_ids]
            values += out.logprobs
            tops += [self._top(t) for t in out.top_logprobs] or [None] * len(out.token_ids)
        offsets, position = [], 0
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if self.logprobs_k else None,
                "text_offset": offsets}

    def _top(self, top: TopLogprobs) -> dict[str, float]:
        k = self.logprobs_k  # the engine scored the larger of this and prompt_logprobs
        return {self.token_text(t): value for t, value in zip(top.token_ids[:k], top.logprobs[:k])}


def prompt_logprobs(prompt_token_ids: list[int], scores: list[PromptLogprob], k: int,
                    token_text: Callable[[int], str]) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per position a map from token id to its
    ``logprob``, ``rank`` and ``decoded_token``: the top ``k`` and the prompt's own token. A prompt token
    outside the engine's top has ``rank`` null (its rank is known only to be past them)."""
    rendered: list[dict[str, dict] | None] = [None]
    for token, score in zip(prompt_token_ids[1:], scores):
        ids, values = score.top.token_ids, score.top.logprobs
        entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": token_text(t)}
                 for r, (t, v) in enumerate(zip(ids[:k], values[:k]))}
        if str(token) not in entry:
            rank = ids.index(token) + 1 if token in ids else None
            entry[str(token)] = {"logprob": score.logprob, "rank": rank, "decoded_token": token_text(token)}
        rendered.append(entry)
    return rendered


class ChatRenderer:
    """``/v1/chat/completions``: messages and deltas, log-probabilities, forced tool calls."""

    def __init__(self, token_text: Callable[[int], str], logprobs_k: int | None, tools: ToolCallMode | None):
        self.token_text = token_text
        self.logprobs_k = logprobs_k
        self.tools = tools
        self._started: set[int] = set()
        self._held: dict[int, ChoiceOutput] = {}  # a tool call's text, held until it is whole

    def delta(self, index: int, event: GenerationEvent) -> dict:
        delta: dict = {}
        if index not in self._started:
            self._started.add(index)
            delta["role"] = "assistant"
        out = ChoiceOutput()
        out.add(event)
        reason = event.finish_reason
        if self.tools is not None:
            held = self._held.setdefault(index, ChoiceOutput())
            held.add(event)
            if reason is not None:
                calls = self.tools.calls(held.text)
                if calls is not None:
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                    reason = "tool_calls"
                else:
                    delta["content"] = held.text
        else:
            delta["content"] = out.text
        return {"index": index, "delta": delta, "logprobs": self._logprobs(out), "finish_reason": reason}

    def choice(self, index: int, out: ChoiceOutput) -> dict:
        message: dict = {"role": "assistant", "content": out.text}
        reason = out.finish_reason
        if self.tools is not None:
            calls = self.tools.calls(out.text)
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": self._logprobs(out), "finish_reason": reason}

    def _logprobs(self, out: ChoiceOutput) -> dict | None:
        if self.logprobs_k is None:
            return None
        tops = out.top_logprobs or [TopLogprobs((), ())] * len(out.token_ids)
        return {"content": [
            {**self._entry(token, value), "top_logprobs": [self._entry(t, v) for t, v in zip(top.token_ids, top.logprobs)]}
            for token, value, top in zip(out.token_ids, out.logprobs, tops)
        ]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


# One thread renders the big responses, one after another: eight at once in eight threads would leave the
# event loop a ninth of the interpreter's turns.
_RENDERER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-render")


async def json_off_loop(build: Callable[..., Any], *args: Any, off_loop: bool = True) -> bytes:
    """``build(*args)`` encoded as JSON in the render thread (``off_loop``; a small one here, no thread hop).

    A response or stream frame with a prompt's scores (echo with logprobs)
    holds every prompt position's top-k: 8,191 x 20 entries take a second of
    CPU to render and encode. On the event loop, every stream the ingress
    serves would wait that long; in a thread, the loop keeps its turns.
    """
    if not off_loop:
        return msgspec.json.encode(build(*args))
    return await asyncio.get_running_loop().run_in_executor(_RENDERER, lambda: msgspec.json.encode(build(*args)))


async def sse_frame(build: Callable[..., Any], *args: Any, off_loop: bool) -> str:
    """One server-sent event of ``build(*args)``, built off the event loop where it is big (``json_off_loop``)."""
    if off_loop:
        return f"data: {(await json_off_loop(build, *args)).decode()}\n\n"
    return f"data: {json.dumps(build(*args), separators=(',', ':'))}\n\n"
