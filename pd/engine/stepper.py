"""One engine step after its polls: schedule, start the step's transfers, run the model, update.

Synchronously, each step read before the next is scheduled; or with async
scheduling (``EngineConfig.async_scheduling``, ``pd.engine.overlap``), the
next step launched before the one in flight is read. Either way a step
returns the scheduler's outputs; the engine then finishes them (pins a
prefill's KV, forgets the requests that ended).
"""

from __future__ import annotations

import functools
import time

from pd.config import EngineConfig
from pd.engine.disagg.connector import KVConnector
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import RequestOutput, SchedulerOutput
from pd.engine.overlap import StepPipeline, launches_ahead
from pd.engine.scheduler import Scheduler
from pd.engine.step_times import StepTimes
from pd.engine.tiers.base import Tiers
from router.step_cost import StepShape, StepSums

# A step with nothing to run but tier loads in flight waits this long at most for one to land.
LOAD_WAIT_S = 0.005


class Stepper:
    """Runs the engine's steps and times them (``step_times``, ``step_sums``). Not thread-safe."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, tiers: Tiers,
                 connector: KVConnector, step_times: StepTimes, step_sums: StepSums):
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.tiers = tiers
        self.connector = connector
        self.step_times = step_times
        self.step_sums = step_sums

    @functools.cached_property
    def pipeline(self) -> StepPipeline | None:
        """With async scheduling: the step in flight, launched before the one before it is read.
        None: each step is read before the next is scheduled."""
        if not launches_ahead(self.config, self.runner):
            return None
        return StepPipeline(self.scheduler, self.runner, self.scheduler.kv_cache, self.step_times, self.step_sums)

    @property
    def in_flight(self) -> bool:
        """A step launched and not yet read (async scheduling): the next ``step`` returns its outputs."""
        return self.pipeline is not None and self.pipeline.in_flight is not None

    def has_runnable_requests(self) -> bool:
        """Requests the scheduler can run now (not only waiting for their KV to arrive), or a step to read."""
        return bool(self.scheduler.running or self.scheduler.waiting) or self.in_flight

    def step(self, may_wait: bool) -> list[RequestOutput]:
        """Schedule, run the model, update: the outputs read this step.

        ``may_wait``: the engine has nothing else to return now, so a step with
        nothing to run but tier loads in flight waits a little for one to land.
        """
        if self.pipeline is not None:
            return self._step_ahead(self.pipeline, may_wait)
        out = self.scheduler.schedule()
        self._start_transfers(out)
        if out.is_empty:
            self._wait_if_idle(may_wait)
            return []
        return self._run(out)

    def _step_ahead(self, pipeline: StepPipeline, may_wait: bool) -> list[RequestOutput]:
        """Schedule and launch the next step, then read the one in flight (``pd.engine.overlap``)."""
        results = pipeline.drain() if pipeline.reads_before_schedule() else []
        out = self.scheduler.schedule()
        if out.remote_reads:  # pulls write outside the device's stream order: the step in flight lands first
            results += pipeline.drain()
        self._start_transfers(out)
        results += pipeline.run(out)
        if out.is_empty and not results and pipeline.in_flight is None:
            self._wait_if_idle(may_wait)
        return results

    def _wait_if_idle(self, may_wait: bool) -> None:
        """With nothing to return or run, but tier loads in flight: wait for one a little, not spin."""
        if may_wait and not self.has_runnable_requests():
            self.tiers.wait_for_loads(LOAD_WAIT_S)

    def _start_transfers(self, out: SchedulerOutput) -> None:
        """The tiers' copies into the blocks just reused, then the step's pulls, which write into blocks too."""
        self.tiers.before_run(remote_writes=bool(out.remote_reads))
        self.connector.start_pulls(out.remote_reads)

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Run the model on ``out`` and update the scheduler with what it sampled; time the step."""
        kv_cache = self.scheduler.kv_cache
        block_tables = [kv_cache.block_ids(s.request.request_id) for s in out.scheduled]
        shape = StepShape.of(out.scheduled)
        started, computed = time.monotonic(), self.scheduler.num_computed_prompt_tokens
        forward = self.runner.execute(out, block_tables)
        self.scheduler.launched(out)
        results = self.scheduler.update(out, forward)
        seconds = time.monotonic() - started if forward.modelled_seconds is None else forward.modelled_seconds
        self.step_times.record(seconds, self.scheduler.num_computed_prompt_tokens - computed, len(out.scheduled))
        self.step_sums.record(shape, seconds)
        if self.scheduler.speculator is not None:  # it prices drafts by the steps' measured times
            self.scheduler.speculator.record_step(shape.num_tokens, seconds)
        return results
