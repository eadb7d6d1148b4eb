"""``n`` choices of one prompt, run as ``n`` sequences that compute the prompt once.

Choice 0 runs first, on whatever path the prompt would take alone. As soon as
it streams from a decode replica, that replica holds the prompt's KV in its
prefix cache, and choice 1 starts there, pinned to it and prefilled locally:
every full block of the prompt is a cache hit, so the prompt costs once (plus,
per choice, the last partial block). Each later choice starts on its
predecessor's first token, one at a time. Never several at once: calls made
while one HTTP request is handled inherit its Serve request context, so they
share one ``internal_request_id``, and Serve's router indexes the calls it is
still placing by that id (Ray 2.60, ``_pending_requests_by_id``). Issued
together, all but one were never placed (seen: two of three hung). Started
one at a time, each is placed before the next is made. Each choice has its own
request id and, when the request has a seed, its own seed derived from it
(choice 0 keeps the request's seed, so ``n=1`` is what it always was). The
prompt's scores (echo with logprobs) are choice 0's, handed to the others: a
choice that scored the prompt again would compute every position, cached or
not, on the decode replica.

One choice failing fails the request: its other choices are cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from pd.sampling_params import SamplingParams, position_seed
from pd.serve.generation import GenerationEvent, PoolClient
from pd.serve.protocol import LoraRef
from pd.serve.timeline import Timeline

_CHOICE_SEED_SALT = 0x5EED_C401CE


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: the request's own for choice 0, a distinct derived one after."""
    if seed is None or index == 0:
        return seed
    return position_seed(seed ^ _CHOICE_SEED_SALT, index)


class _Done:
    """A choice's end marker on the merge queue."""


async def run_choices(pools: PoolClient, request_id: str, token_ids: list[int], params: SamplingParams,
                      stop: list[str], n: int, timeline: Timeline | None = None, lora: LoraRef | None = None,
                      priority: int = 0) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """``(choice index, event)`` pairs of ``n`` choices, interleaved as they arrive (all in one ``timeline``),
    each run under the LoRA adapter ``lora`` (None: the base model) at scheduling ``priority``."""
    if n == 1:
        async for event in pools.generate(request_id, token_ids, params, stop, timeline=timeline, lora=lora,
                                          priority=priority):
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    prompt_scores: list = []  # choice 0's prompt logprobs, once it has them

    async def run(index: int, decode_replica: str | None) -> None:
        choice_id = f"{request_id}-{index}"
        choice_params = params.replace(seed=choice_seed(params.seed, index))
        if index > 0:  # the prompt's scores are choice 0's: scored again, no cached block would serve it
            choice_params = choice_params.replace(prompt_logprobs=None)
        first = True
        try:
            async for event in pools.generate(choice_id, token_ids, choice_params, stop,
                                              decode_replica=decode_replica, timeline=timeline, lora=lora,
                                              priority=priority):
                if index == 0 and event.prompt_logprobs is not None:
                    prompt_scores.append(event.prompt_logprobs)
                elif first and index > 0 and prompt_scores:
                    event = dataclasses.replace(event, prompt_logprobs=prompt_scores[0])
                first = False
                if len(tasks) == index + 1:
                    start_next(pools.decode_replica_of(choice_id) or decode_replica, event.finish_reason is not None)
                queue.put_nowait((index, event))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            if len(tasks) == index + 1:
                start_next(decode_replica, True)  # it ended before reaching a decode replica
            queue.put_nowait((index, _Done))

    def start_next(replica: str | None, finished: bool) -> None:
        """Start the next choice once this one streams from a decode replica (or has ended)."""
        if len(tasks) < n and (replica is not None or finished):
            tasks.append(asyncio.ensure_future(run(len(tasks), replica)))

    tasks.append(asyncio.ensure_future(run(0, None)))
    try:
        num_done = 0
        while num_done < n:
            index, item = await queue.get()
            if item is _Done:
                num_done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
