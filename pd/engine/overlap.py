"""Async scheduling: step N+1 is scheduled and launched before step N is read.

As vLLM v1's async scheduling and SGLang's overlap scheduler do it. While
step N runs on the device, the host schedules N+1 assuming every request N
samples for gets its token (``Request.num_unread_tokens``), builds its inputs
and queues it; a decode row's input token is taken from N's draws on the
device (``ModelRunner.flatten``). Only then does it read N's tokens (the
step's one sync, ``pd.engine.readback``) and finish N's outputs: stop
tokens, ``max_tokens``, errors. A request N ended has its row in N+1
discarded (never emitted) when N+1 is read; its blocks are freed at once,
and N+1's writes into them land before any later step's, in stream order.

    host:    | sched N+1 | launch N+1 | read N | update N | sched N+2 | launch N+2 | read N+1 | ...
    device:  |      forward N         |        forward N+1            |         forward N+2 ...

A request certain to end by length with N's token (``max_tokens``,
``max_model_len``; a prefill's one token) is not scheduled in N+1 at all.

A step whose schedule depends on what the host reads runs synchronously: N
is read before N+1 is scheduled when N has grammar rows (their masks need
N's tokens), and when the next schedule may preempt (a schedule that knows
N's finishes is the synchronous one, exactly). A schedule that starts KV
pulls reads N first: pulls write into blocks outside the device's stream
order, and a block freed under N may be among them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pd.config import EngineConfig
from pd.engine.kv_cache_manager import KVCacheManager
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import RequestOutput, SchedulerOutput
from pd.engine.readback import LaunchedStep
from pd.engine.scheduler import Scheduler
from pd.engine.step_times import StepTimes
from router.step_cost import StepShape, StepSums


def launches_ahead(config: EngineConfig, runner: ModelRunner) -> bool:
    """``async_scheduling`` made concrete: on, off, or "auto" (on CUDA); only where the runner can."""
    wanted = config.async_scheduling
    if wanted == "auto":  # a verify step's accepted tokens decide the next step's inputs: synchronous
        wanted = config.device.startswith("cuda") and config.speculative_config is None
    return bool(wanted) and getattr(runner, "can_launch_ahead", False)


@dataclass
class InFlightStep:
    """A step launched and not yet read."""

    out: SchedulerOutput
    launched: LaunchedStep
    shape: StepShape
    started: float = field(default_factory=time.monotonic)


class StepPipeline:
    """The engine's steps under async scheduling: at most one in flight, read when the next is launched."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv_cache: KVCacheManager, step_times: StepTimes,
                 step_sums: StepSums):
        self.scheduler = scheduler
        self.runner = runner
        self.kv_cache = kv_cache
        self.step_times = step_times
        self.step_sums = step_sums
        self.in_flight: InFlightStep | None = None
        self.num_launched_ahead = 0  # steps launched while another was in flight
        self.num_drained = 0  # steps read before the next could be scheduled

    def reads_before_schedule(self) -> bool:
        """Whether the step in flight must be read before the next is scheduled (see the module's doc)."""
        step = self.in_flight
        return step is not None and (step.launched.mask is not None or self._may_preempt())

    def _may_preempt(self) -> bool:
        """Whether the next schedule's running requests may need more blocks than are free."""
        scheduler, free = self.scheduler, self.kv_cache.pool.num_free_blocks
        budget, block_size = scheduler.config.max_num_batched_tokens, self.kv_cache.block_size
        if free >= len(scheduler.running) + -(-budget // block_size):  # each takes <= 1 + its tokens' blocks
            return False
        need = 0
        for request in scheduler.running:
            num_new = min(request.num_tokens_with_unread - request.num_scheduled_tokens, budget)
            if num_new <= 0:
                continue
            total = request.num_scheduled_tokens + num_new
            need += max(0, -(-total // block_size) - len(self.kv_cache.block_ids(request.request_id)))
            budget -= num_new
            if budget <= 0:
                break
        return need > free

    def drain(self) -> list[RequestOutput]:
        """Read the step in flight, if any, and finish its outputs."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return []
        self.num_drained += 1
        return self._read(step)

    def run(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Launch ``out``, then read the step in flight before it: that step's outputs."""
        out.scheduled = [item for item in out.scheduled if not item.request.is_finished]  # ended by a drain
        if out.is_empty:
            return self.drain()
        previous = self.in_flight
        block_tables = [self.kv_cache.block_ids(item.request.request_id) for item in out.scheduled]
        shape = StepShape.of(out.scheduled)
        try:
            launched = self.runner.launch(out, block_tables, previous.launched if previous is not None else None)
        except BaseException:
            self.in_flight = None  # the engine fails its requests; nothing in flight is read again
            raise
        self.scheduler.launched(out)
        self.in_flight = InFlightStep(out, launched, shape)
        if previous is None:
            return []
        self.num_launched_ahead += 1
        return self._read(previous)

    def _read(self, step: InFlightStep) -> list[RequestOutput]:
        forward = self.runner.collect(step.launched)
        computed = self.scheduler.num_computed_prompt_tokens
        results = self.scheduler.update(step.out, forward)
        seconds = time.monotonic() - step.started
        self.step_times.record(seconds, self.scheduler.num_computed_prompt_tokens - computed, len(step.out.scheduled))
        self.step_sums.record(step.shape, seconds)
        return results
