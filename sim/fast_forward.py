"""Fast-forward: a replica's next decode steps, planned at once and applied to its engine when they matter.

    engine step ── run of k decode-only steps: one event, at the k-th's end ── engine step ...
                         ▲ an arrival or a wake mid-run: the steps begun by then are applied,
                           the run ends with the one in progress, and the next step is the engine's

While every request an engine runs is a decode that neither finishes nor waits for anything, nothing is
queued and nothing else can reach the engine, its next steps change only token counts, so their shapes,
hence their modelled times, are known ahead: each of the ``R`` sequences computes one token a step, a
decode at context ``c`` attends to ``c + 1`` keys, and a step's pairs grow by ``R`` from one to the next.
A run stops before the first step in which a request finishes, and at the last step for which the pool
holds a free block for every block boundary its requests cross (so none can be preempted): the engine's
own step decides every step that could go otherwise.

A run's steps are applied in order through the scheduler's ``advance_decodes`` (the real KV cache
manager and block pool allocate and cache at the boundaries: the same blocks and prefix-cache events as
stepping), the runner's one seeded stream (the same token ids) and the engine's own accounting
(``step_times``, ``step_sums``: each step with its own shape and seconds). They are applied lazily: when
the run ends, and when the engine is read or reached mid-run (a report, a router, an arrival), up to the
steps begun by then, as stepping would have them. What the applied steps stream goes on as one
``RunOutputs``, each token at its own step's end.

What keeps a replica stepping one step at a time: a shared host (its steps stretch with the others'),
KV tiers, transfers or leases in flight, logprobs, stop tokens, a grammar, an EOS that could stop a request,
a LoRA adapter not in a device slot (its load is the engine's step's).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from pd.engine.engine import LLMEngine
from pd.engine.request import Request
from pd.engine.tiers.base import NO_TIERS
from router.step_cost import StepShape

MIN_RUN_STEPS = 2  # a run of one step saves nothing over the engine's own


def run_length(engine: LLMEngine) -> int:
    """How many of the engine's next steps can be fast-forwarded from now (0: the next is its own)."""
    scheduler = engine.scheduler
    running = scheduler.running
    if (not running or scheduler.waiting or scheduler.remote_waiting or engine.tiers is not NO_TIERS
            or scheduler.speculator is not None  # a verify step's tokens are the speculator's to plan
            or engine.has_pending_transfers() or len(running) > scheduler.config.max_num_batched_tokens):
        return 0
    if not engine.runner.holds_adapters(_adapters(running)):
        return 0
    max_model_len = scheduler.config.max_model_len
    steps = max_model_len
    for request in running:
        if not _plain_decode(request):
            return 0
        # The step that samples a request's last token is the engine's: the run ends before it.
        steps = min(steps, request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                    max_model_len - request.num_tokens - 1)
    return _within_free_blocks(engine, steps) if steps >= MIN_RUN_STEPS else 0


def _adapters(running: list[Request]) -> frozenset:
    """The LoRA adapters of ``running`` (``AdapterId``s)."""
    return frozenset(request.lora for request in running if request.lora is not None)


def _plain_decode(request: Request) -> bool:
    """A decode whose next tokens can end it only by its length, and report nothing but themselves."""
    params = request.sampling_params
    return (request.num_tokens - request.num_computed_tokens == 1 and request.grammar is None
            and params.logprobs is None and params.prompt_logprobs is None and not params.stop_token_ids
            and (params.ignore_eos or not request.eos_token_ids))


def _within_free_blocks(engine: LLMEngine, steps: int) -> int:
    """The most of ``steps`` steps whose block boundaries the pool's free blocks cover (0: under two)."""
    block_size = engine.scheduler.config.block_size
    held = [(request.num_computed_tokens, len(engine.kv_cache.block_ids(request.request_id)))
            for request in engine.scheduler.running]
    free = engine.block_pool.num_free_blocks

    def fits(num_steps: int) -> bool:  # step j allocates for num_computed + j tokens
        return sum(max(0, -(-(computed + num_steps) // block_size) - blocks) for computed, blocks in held) <= free

    if fits(steps):
        return steps
    low, high = 0, steps  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low if low >= MIN_RUN_STEPS else 0


@dataclass(frozen=True)
class RunOutputs:
    """What a run's applied steps streamed: ``token_ids[i][step]`` for ``request_ids[i]``, each step's
    tokens at its end, ``ends_s[step]``. No request finishes among them (a run ends before)."""

    request_ids: list[str]
    token_ids: list[list[int]]
    ends_s: list[float]

    def token_times(self, delay_s: float = 0.0) -> list[tuple[str, list[float]]]:
        """Each request's new tokens' times, seen ``delay_s`` after their steps end."""
        times = [end + delay_s for end in self.ends_s] if delay_s else list(self.ends_s)
        return [(request_id, times) for request_id in self.request_ids]


class DecodeRun:
    """``num_steps`` decode steps of an engine's running batch from ``start_s``, applied up to ``num_applied``."""

    def __init__(self, engine: LLMEngine, start_s: float, num_steps: int):
        running = engine.scheduler.running
        self.request_ids = [request.request_id for request in running]
        self.num_seqs = num_seqs = len(running)
        self.first_pairs = sum(request.num_computed_tokens + 1 for request in running)
        # Every step priced at once by the runner's own cost, its pairs an array: the same float operations.
        pairs = self.first_pairs + num_seqs * np.arange(num_steps, dtype=np.int64)
        seconds, self.threads = engine.runner.price(StepShape(num_seqs, pairs, num_seqs, num_seqs))
        seconds = np.broadcast_to(np.asarray(seconds, dtype=np.float64), (num_steps,))
        # Each step ends where the event loop's sum puts it: one addition after another (accumulate is sequential).
        ends = np.add.accumulate(np.concatenate(([start_s], seconds)))
        self.seconds: list[float] = seconds.tolist()
        self.starts_s: list[float] = ends[:-1].tolist()
        self.ends_s: list[float] = ends[1:].tolist()
        self.num_applied = 0

    @property
    def num_steps(self) -> int:
        return len(self.seconds)

    def num_begun(self, now_s: float) -> int:
        """The steps begun by ``now_s`` (one in progress included)."""
        return bisect.bisect_right(self.starts_s, now_s, hi=self.num_steps)

    def truncate(self, num_steps: int) -> None:
        """End the run after its first ``num_steps`` (at least those applied)."""
        del self.seconds[num_steps:], self.starts_s[num_steps:], self.ends_s[num_steps:]

    def apply(self, engine: LLMEngine, upto: int) -> RunOutputs | None:
        """Apply steps ``num_applied .. upto - 1`` to ``engine``, as its own steps would; what they streamed."""
        first, self.num_applied = self.num_applied, max(self.num_applied, upto)
        if upto <= first:
            return None
        num_seqs = self.num_seqs
        sampled = engine.runner.sample(num_seqs * (upto - first))
        engine.scheduler.advance_decodes([sampled[row:row + num_seqs] for row in range(0, len(sampled), num_seqs)])
        seconds = self.seconds[first:upto]
        step_times, step_sums = engine.step_times, engine.step_sums
        for step, step_seconds in enumerate(seconds, first):
            step_times.record(step_seconds, 0, num_seqs)
            step_sums.record(StepShape(num_seqs, self.first_pairs + num_seqs * step, num_seqs, num_seqs), step_seconds)
        engine.runner.record_run(seconds, self.threads)
        return RunOutputs(self.request_ids, [sampled[index::num_seqs] for index in range(num_seqs)],
                          self.ends_s[first:upto])
