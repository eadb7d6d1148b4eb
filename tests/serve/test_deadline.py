"""The request deadline closes a slow generation (and with it the pools' work)."""

from __future__ import annotations

import asyncio

import pytest

from pd.serve.openai_protocol import OpenAIError
from pd.serve.stream import with_deadline


def test_slow_generation_times_out_and_is_closed():
    closed = []

    async def slow():
        try:
            yield "first"
            await asyncio.sleep(30)
            yield "never"
        finally:
            closed.append(True)

    async def run():
        got = []
        with pytest.raises(OpenAIError) as info:
            async for event in with_deadline(slow(), 0.2):
                got.append(event)
        return got, info.value

    got, error = asyncio.run(run())
    assert got == ["first"] and error.status == 504 and closed == [True]


def test_fast_generation_is_untouched():
    async def fast():
        for i in range(3):
            yield i

    async def run():
        return [e async for e in with_deadline(fast(), 5)]

    assert asyncio.run(run()) == [0, 1, 2]
