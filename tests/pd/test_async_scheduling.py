"""Async scheduling (``pd.engine.overlap``), forced on on CPU: every output equals the synchronous engine's."""

from __future__ import annotations

import pytest

from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.engine.request import FinishReason
from pd.sampling_params import SamplingParams, StructuredKind, StructuredOutput

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True, logprobs=2)


def engine(model: str, ahead: bool, **options) -> LLMEngine:
    config = EngineConfig(model=model, num_blocks=options.pop("num_blocks", 64), max_model_len=256,
                          async_scheduling=ahead, **options)
    return LLMEngine(config)


def run(engine: LLMEngine, plan: dict[int, list[tuple]]) -> dict[str, dict]:
    """Step until done; before step call ``k``, apply ``plan[k]``: ("add", id, prompt, params) or ("abort", id).

    Returns each request's tokens, logprobs, top logprobs, prompt logprobs and finish reason.
    """
    outputs: dict[str, dict] = {}
    calls = 0
    while engine.has_unfinished_requests() or calls <= max(plan):
        for action in plan.get(calls, ()):
            if action[0] == "add":
                _, request_id, prompt, params = action
                engine.add_request(request_id, prompt, params)
                outputs[request_id] = {"tokens": [], "logprobs": [], "tops": [], "prompt": None, "reason": None}
            else:
                engine.abort_request(action[1])
                outputs[action[1]]["reason"] = FinishReason.ABORT
        calls += 1
        for result in engine.step():
            out = outputs[result.request_id]
            assert out["reason"] is None, f"{result.request_id} has an output after it finished"
            out["tokens"] += result.new_token_ids
            out["logprobs"] += result.new_logprobs
            out["tops"] += result.new_top_logprobs
            if result.prompt_logprobs is not None:
                out["prompt"] = result.prompt_logprobs
            if result.finished:
                out["reason"] = result.finish_reason
        assert calls < 500
    assert engine.stats().num_used_blocks == 0
    return outputs


def both(model: str, plan: dict[int, list[tuple]], **options) -> tuple[dict, dict, LLMEngine]:
    sync = run(engine(model, False, **options), plan)
    ahead_engine = engine(model, True, **options)
    ahead = run(ahead_engine, plan)
    assert ahead_engine.pipeline is not None and ahead_engine.pipeline.num_launched_ahead > 0
    return sync, ahead, ahead_engine


def prompt(length: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % 500 + 1 for i in range(length)]


def test_mixed_requests_chunked_prefill_and_stops_equal_the_synchronous_engine(checkpoint):
    model = str(checkpoint("llama"))
    free = run(engine(model, False), {0: [("add", "free", prompt(9, 3), GREEDY)]})["free"]["tokens"]
    stop = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free[4]], ignore_eos=True)
    plan = {
        0: [("add", "greedy", prompt(20), GREEDY), ("add", "seeded", prompt(5, 2), SEEDED),
            ("add", "stops", prompt(9, 3), stop)],
        2: [("add", "short", prompt(3, 4), SamplingParams(max_tokens=1, temperature=0))],
        # A long prompt prefilled in chunks of the budget while the others decode.
        3: [("add", "long", prompt(90, 5), SamplingParams(max_tokens=6, temperature=0, logprobs=0,
                                                            prompt_logprobs=1))],
        5: [("add", "seeded2", prompt(40, 6), SamplingParams(max_tokens=8, temperature=1.0, seed=3))],
    }
    sync, ahead, _ = both(model, plan, max_num_batched_tokens=32)
    assert sync["stops"]["reason"] is FinishReason.STOP and len(sync["stops"]["tokens"]) < 12
    assert sync["short"]["tokens"] and sync["long"]["prompt"]
    assert ahead == sync


def test_an_abort_mid_stream_drops_the_unread_token_and_the_rest_is_unchanged(checkpoint):
    model = str(checkpoint("llama"))
    plan = {0: [("add", "keep", prompt(30), GREEDY), ("add", "drop", prompt(12, 2), GREEDY),
                ("add", "seeded", prompt(7, 3), SEEDED)],
            5: [("abort", "drop")]}
    sync, ahead, _ = both(model, plan, max_num_batched_tokens=16)
    assert ahead["keep"] == sync["keep"] and ahead["seeded"] == sync["seeded"]
    # The aborted stream's last token may still be on the device: it is never emitted.
    dropped, dropped_sync = ahead["drop"]["tokens"], sync["drop"]["tokens"]
    assert dropped == dropped_sync[:len(dropped)] and len(dropped) >= len(dropped_sync) - 1


def test_a_pool_short_of_blocks_preempts_as_the_synchronous_engine_does(checkpoint):
    model = str(checkpoint("llama"))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plan = {0: [("add", f"r{i}", prompt(20 + 5 * i, i), params) for i in range(4)]}
    sync, ahead, ahead_engine = both(model, plan, num_blocks=12, block_size=8)
    assert ahead_engine.stats().num_preemptions > 0
    assert ahead == sync


def test_structured_output_reads_each_step_before_the_next_and_matches(checkpoint):
    structured = SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput(
        kind=StructuredKind.CHOICE, spec='["yes", "no", "maybe so"]'))
    plan = {0: [("add", "choice", prompt(6), structured), ("add", "greedy", prompt(10, 2), GREEDY)]}
    sync, ahead, ahead_engine = both("builtin:tiny-llama", plan)
    assert ahead == sync and sync["choice"]["reason"] is FinishReason.STOP
    assert ahead_engine.pipeline.num_drained > 0


@pytest.mark.parametrize("value", ["on", 1, None])
def test_async_scheduling_takes_a_bool_or_auto(value):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=value)
    assert EngineConfig(async_scheduling="auto").async_scheduling == "auto"
