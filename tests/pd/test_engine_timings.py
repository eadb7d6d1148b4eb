"""An engine reports where each request's time went, once, with its first token (``EngineTimings``)."""

from __future__ import annotations

import time

from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.sampling_params import SamplingParams


def _run(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_the_first_output_with_a_token_carries_the_timings_and_no_other_does():
    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=64, max_num_seqs=1))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    started = time.monotonic()
    engine.add_request("first", list(range(1, 40)), params)
    engine.add_request("second", list(range(1, 40)), params)  # waits for "first" (one sequence at a time)
    outputs = _run(engine)
    elapsed = time.monotonic() - started
    for request_id, outs in outputs.items():
        with_tokens = [out for out in outs if out.new_token_ids]
        assert with_tokens[0].timings is not None, request_id
        assert all(out.timings is None for out in outs if out is not with_tokens[0]), request_id
    first, second = (outputs[name][0].timings for name in ("first", "second"))
    assert 0 < first.first_token_s < elapsed and first.queue_s < first.first_token_s
    # The second queued behind the whole first request, then hit the prompt's blocks it left cached.
    assert second.queue_s > first.first_token_s
    assert second.num_cached_tokens == 32 and first.num_cached_tokens == 0
    assert first.pull_s == 0.0 and first.num_pulled_blocks == 0


def test_the_timings_count_the_steps_that_computed_the_prompt():
    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=64, max_num_batched_tokens=16))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("long", list(range(1, 40)), params)  # 39 tokens in chunks of at most 16
    long = _run(engine)["long"][0].timings
    engine.add_request("cached", list(range(1, 40)), params)  # 32 cached: the last 7 in one step
    cached = _run(engine)["cached"][0].timings
    assert (long.num_prompt_chunks, cached.num_prompt_chunks) == (3, 1)


def test_a_request_added_during_a_step_counts_its_wait_for_that_step_as_queue():
    """The asyncio engine takes a request in only between steps; its queue time counts from the add call."""
    import asyncio
    import threading

    from pd.engine.async_engine import AsyncLLMEngine

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    held_s = 0.3

    async def main():
        engine = AsyncLLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=64))
        inner, entered, gate = engine.engine, threading.Event(), threading.Event()
        step = inner.step

        def held_step():
            if not gate.is_set():
                entered.set()
                gate.wait(30)
            return step()

        inner.step = held_step
        first = asyncio.ensure_future(_last(engine.add_request("first", list(range(1, 20)), params)))
        assert await asyncio.to_thread(entered.wait, 30)  # the first step is in flight
        second = asyncio.ensure_future(_last(engine.add_request("second", list(range(30, 50)), params)))
        await asyncio.sleep(held_s)  # the step in flight lasts this long (the interval measured, not a wait)
        gate.set()
        timings = [await first, await second]
        await engine.shutdown()
        return timings

    async def _last(stream):
        timings = None
        async for out in stream:
            timings = timings or out.timings
        return timings

    _, second = asyncio.run(main())
    assert second.queue_s >= held_s  # taken in after the held step: its wait counted from the add
