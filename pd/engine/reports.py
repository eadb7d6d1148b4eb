"""What an engine reports: its counters (``EngineStats``), and what its replica publishes to the request
routers (``RoutingStats``: load, step sums, the prefix cache's event window, the adapters in its slots)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd.engine.stats import EngineStats
from router.protocol import RoutingStats

if TYPE_CHECKING:
    from pd.engine.engine import LLMEngine
    from pd.engine.scheduler import Scheduler


def uncomputed_prompt_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens still to compute, queued or running. Safe to call from another thread."""
    pending = list(scheduler.waiting) + list(scheduler.running)
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in pending)


def load_shape(scheduler: Scheduler) -> tuple[int, int, int, int]:
    """What is left to run on ``scheduler``, as a latency predictor prices it (``router.latency``).

    ``(prompt tokens still to compute, their query-key pairs, requests
    decoding, the tokens those decodes attend to)``: a waiting or running
    request still in its prompt counts in the first two, a running one past
    it in the last two. A request not yet admitted counts the prompt after
    the prefix its admission would find cached now: a turn whose long
    history the replica holds is the turn's new tokens, not its whole
    prompt (counted whole, two such turns queued made a holder look seconds
    behind, and a router recomputed the next turn elsewhere). A request
    scoring its prompt computes all of it. Safe to call from another thread.
    """
    tokens = pairs = decoding = context = 0
    waiting = list(scheduler.waiting)
    for index, request in enumerate([*waiting, *scheduler.running]):
        computed = request.num_computed_tokens
        if index < len(waiting) and computed == 0 and not request.num_prompt_logprobs_missing:
            computed = min(request.num_prompt_tokens - 1, scheduler.kv_cache.cached_prefix_tokens(request))
        left = request.num_prompt_tokens - computed
        if left > 0:
            tokens += left
            pairs += left * computed + left * (left + 1) // 2
        elif index >= len(waiting):
            decoding += 1
            context += computed
    return tokens, pairs, decoding, context


def routing_stats(engine: LLMEngine, after_seq: int | None = None) -> RoutingStats:
    """``engine``'s load and prefix-cache event window (only the events after ``after_seq``, if given)."""
    pool, scheduler, pulls = engine.block_pool, engine.scheduler, engine.connector.stats
    free, used = pool.num_free_blocks, pool.num_used_blocks
    waiting_tokens, waiting_pairs, decoding, decode_context = load_shape(scheduler)
    first_seq, events = engine.cache_events(after_seq)
    return RoutingStats.of(
        first_seq, events, num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_waiting_tokens=waiting_tokens, num_waiting_pairs=waiting_pairs, num_decoding=decoding,
        num_decode_context_tokens=decode_context, kv_usage=used / (free + used) if free + used else 0.0,
        num_free_blocks=free, num_pulled_blocks=pulls.num_pulled_blocks,
        pull_seconds_total=pulls.pull_seconds_total, step_gram=tuple(engine.step_sums.gram),
        step_moments=tuple(engine.step_sums.moments),
        adapters=engine.runner.adapter_names() if engine.lora is not None else (),
        max_loras=engine.config.max_loras if engine.lora is not None else 0)


def engine_stats(engine: LLMEngine) -> EngineStats:
    """``engine``'s counters, flat."""
    pool, scheduler = engine.block_pool, engine.scheduler
    return EngineStats(
        num_free_blocks=pool.num_free_blocks,
        num_used_blocks=pool.num_used_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_waiting_tokens=uncomputed_prompt_tokens(scheduler),
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_computed_prompt_tokens=scheduler.num_computed_prompt_tokens,
        num_prefix_hit_tokens=scheduler.num_prefix_hit_tokens,
        num_preemptions=scheduler.num_preemptions,
        **engine.tiers.counters(),
        **vars(engine.step_times),
        **engine.experts.counters(),
        **vars(engine.connector.stats),  # flat scalars: asdict's deep copy cost more than the rest of stats()
        **(vars(engine.speculator.counters) if engine.speculator is not None else {}),
        **(engine.lora.counters() if engine.lora is not None else {}),
    )
