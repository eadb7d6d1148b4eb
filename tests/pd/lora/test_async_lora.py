"""Adapters loaded and unloaded on the served engine (``AsyncLLMEngine``) while it runs: read off the loop,
registered between steps; a running request keeps its adapter through an unload; other weights under a
name are refused."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pd.config import EngineConfig
from pd.engine.async_engine import AsyncLLMEngine
from pd.lora.registry import UnknownAdapter
from pd.sampling_params import SamplingParams
from tests.lora_adapters import make_adapter

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


async def _tokens(engine: AsyncLLMEngine, request_id: str, lora: str | None, max_tokens: int = 6) -> list[int]:
    tokens = []
    stream = engine.add_request(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0), lora=lora)
    async with contextlib.aclosing(stream):
        async for out in stream:
            tokens.extend(out.new_token_ids)
    return tokens


def test_load_serve_unload_while_a_request_runs(checkpoint, tmp_path):
    base = checkpoint("llama")
    path = make_adapter(base, tmp_path / "a", r=4, seed=5)

    async def main():
        engine = AsyncLLMEngine(EngineConfig(model=str(base), dtype="float32", num_blocks=64, enable_lora=True))
        try:
            plain = await _tokens(engine, "p", None)
            digest = await engine.load_lora("a", str(path))
            long_run = asyncio.create_task(_tokens(engine, "long", "a", max_tokens=40))
            adapted = await _tokens(engine, "a1", "a")
            assert adapted != plain
            assert await engine.unload_lora("a") == 1  # "long" still runs on it
            with pytest.raises(UnknownAdapter):
                await _tokens(engine, "a2", "a")
            assert len(await long_run) == 40
            await engine.ensure_lora("a", str(path), digest)  # loaded again: the name was gone
            assert await _tokens(engine, "a3", "a") == adapted
            with pytest.raises(ValueError, match="changed since it was loaded"):
                await engine.ensure_lora("b", str(path), "0" * 32)
            with pytest.raises(ValueError, match="adapter_config.json is missing"):
                await engine.load_lora("c", str(tmp_path))
        finally:
            await engine.shutdown()

    asyncio.run(main())
