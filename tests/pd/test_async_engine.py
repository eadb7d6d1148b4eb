"""The asyncio engine: streaming, concurrency, aborts and bad input."""

from __future__ import annotations

import asyncio

import pytest

from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.engine.async_engine import AsyncLLMEngine
from pd.engine.request import FinishReason

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return str(checkpoint("llama"))


async def _collect(stream):
    tokens, last = [], None
    async for out in stream:
        tokens.extend(out.new_token_ids)
        last = out
    return tokens, last


def test_concurrent_streams_equal_offline_outputs(model_dir):
    prompts = [list(range(1, 1 + n)) for n in (5, 40, 17)]
    expected = [o.token_ids for o in LLM(model_dir, num_blocks=64).generate(prompts, GREEDY)]

    async def main():
        engine = AsyncLLMEngine(EngineConfig(model=model_dir, num_blocks=64))
        results = await asyncio.gather(
            *[_collect(engine.add_request(f"r{i}", p, GREEDY)) for i, p in enumerate(prompts)]
        )
        stats = engine.stats()
        await engine.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert all(last.finish_reason is FinishReason.LENGTH for _, last in results)
    assert stats.num_used_blocks == 0 and stats.num_running == 0


def test_abort_and_early_close_free_blocks(model_dir):
    async def main():
        engine = AsyncLLMEngine(EngineConfig(model=model_dir, num_blocks=64))
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        aborted = engine.add_request("a", list(range(1, 30)), long)
        first = await aborted.__anext__()
        assert first.new_token_ids
        engine.abort("a")
        rest = [out async for out in aborted]
        assert rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT

        closed = engine.add_request("b", list(range(1, 30)), long)
        await closed.__anext__()
        await closed.aclose()  # the consumer leaves early
        # The abort is applied between steps; a short request proves the loop moved on.
        tokens, _ = await _collect(engine.add_request("c", [1, 2, 3], GREEDY))
        assert len(tokens) == 12
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = asyncio.run(main())
    assert stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_bad_input_raises_before_queueing(model_dir):
    async def main():
        engine = AsyncLLMEngine(EngineConfig(model=model_dir, num_blocks=64))
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("x", [], GREEDY)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request("x", [10**6], GREEDY)
        tokens, _ = await _collect(engine.add_request("x", [1, 2], GREEDY))
        with pytest.raises(ValueError, match="already in use"):
            stream = engine.add_request("y", [1], GREEDY)
            engine.add_request("y", [1], GREEDY)
        await stream.aclose()
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == 12


def test_freed_memory_goes_back_to_the_os_when_idle_and_while_busy(model_dir, monkeypatch):
    import threading

    import pd.engine.async_engine as async_engine
    from pd.engine.memory import release_free_memory

    assert release_free_memory()  # glibc on this platform: the call is real
    calls = []
    monkeypatch.setattr(async_engine, "release_free_memory", lambda: calls.append(threading.current_thread().name))

    async def main():
        engine = AsyncLLMEngine(EngineConfig(model=model_dir, num_blocks=64))
        await _collect(engine.add_request("a", list(range(1, 20)), GREEDY))
        while not calls:  # the loop goes idle after the request: one release
            await asyncio.sleep(0.01)
        idle_calls = len(calls)
        monkeypatch.setattr(async_engine, "MEMORY_RELEASE_INTERVAL_S", 0.0)  # busy: after every step
        await _collect(engine.add_request("b", list(range(1, 20)), GREEDY))
        await engine.shutdown()
        return idle_calls

    idle_calls = asyncio.run(main())
    assert idle_calls == 1
    assert len(calls) >= 1 + GREEDY.max_tokens
    assert all(name.startswith("pd-engine-step") for name in calls)  # between steps, on the step thread


def test_grammars_compile_off_the_event_loop():
    """A grammar's compile (and xgrammar's first load) never runs on the loop that serves every stream."""
    import threading

    from pd.sampling_params import StructuredKind, StructuredOutput

    constraint = StructuredOutput(kind=StructuredKind.REGEX, spec="[ab]{3}")
    params = SamplingParams(max_tokens=8, temperature=0, structured=constraint)

    async def main():
        engine = AsyncLLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=64))
        loop_thread = threading.current_thread()
        compiled_on = []
        compiler = engine.engine.grammar_compiler
        original = compiler.compile

        def recording(c):
            compiled_on.append(threading.current_thread())
            return original(c)

        compiler.compile = recording
        await engine.compile_constraint(params)
        tokens, last = await _collect(engine.add_request("g", [5, 6, 7], params))
        await engine.shutdown()
        return loop_thread, compiled_on, engine.tokenizer.decode(tokens), last

    loop_thread, compiled_on, text, last = asyncio.run(main())
    assert compiled_on[0] is not loop_thread
    assert text in {a + b + c for a in "ab" for b in "ab" for c in "ab"} and last.finish_reason is FinishReason.STOP


STEP_THREADS_SCRIPT = """
import ctypes, sys, torch
from pd.config import EngineConfig
from pd.engine.async_engine import AsyncLLMEngine

gomp = ctypes.CDLL(next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line))
engine = AsyncLLMEngine(EngineConfig(model=sys.argv[1], num_blocks=16, num_threads=2))
print(gomp.omp_get_max_threads(), engine._executor.submit(gomp.omp_get_max_threads).result())
engine.close()
"""


@pytest.mark.integration  # runs in a child Python
def test_the_step_thread_computes_on_the_engines_threads(model_dir):
    """Ray starts a worker with ``OMP_NUM_THREADS`` at the floor of its CPUs (1 for 1.5). OpenMP gives each new
    thread that count, and oneDNN's GEMMs read it on the thread that calls them: the step thread must be set
    to the engine's own count, or a replica's GEMMs run on one thread whatever ``num_threads`` says."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", STEP_THREADS_SCRIPT, model_dir], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["2", "2"], done.stdout
