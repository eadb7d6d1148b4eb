"""One replica serving a trace in simulated time, and what each request saw.

    arrival ──> engine queue ──> step ... step ──> finished
                (admitted at the next step start)   (outputs land at each step's end)

The replica steps back to back while it has work, as ``AsyncLLMEngine``'s
loop does; a request arriving during a step is admitted at the next one.
The engine is a real ``LLMEngine`` with a modelled runner (``sim.engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from pd.engine.engine import LLMEngine
from pd.engine.outputs import RequestOutput
from pd.sampling_params import SamplingParams
from pd.workload.stats import percentile
from pd.workload.token_prompts import scaled, trace_prompt_token_ids
from pd.workload.trace import TraceRequest
from sim.clock import EventLoop
from sim.fast_forward import DecodeRun, RunOutputs, run_length
from sim.host import SharedHost


@dataclass
class RequestRecord:
    arrival_s: float
    num_prompt_tokens: int
    token_times_s: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished_s: float | None = None

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s

    def add(self, output: RequestOutput, now_s: float) -> None:
        """An engine's output for this request, seen at ``now_s``."""
        self.token_times_s += [now_s] * len(output.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            self.finished_s = now_s

    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:])]


class SimReplica:
    """Steps one engine from the event loop, as ``AsyncLLMEngine``'s loop does, and hands on its outputs.

    ``on_outputs`` gets a step's ``RequestOutput``s at the end of the step
    that made them, in the engine's order; or, for steps fast-forwarded
    (``fast_forward``, ``sim.fast_forward``), a ``RunOutputs`` of several
    steps' tokens with their steps' end times, no later than its last step's
    end. ``busy_s`` adds up the modelled time of the steps run. ``engine``
    is the engine as stepping would have it now (a run's steps begun by now applied).
    """

    def __init__(self, loop: EventLoop, engine: LLMEngine, replica_id: str = "replica",
                 on_outputs: Callable[[list[RequestOutput] | RunOutputs], None] | None = None,
                 host: SharedHost | None = None, threads: int = 1, fast_forward: bool = True):
        self.loop = loop
        self._engine = engine
        self.replica_id = replica_id
        self.on_outputs = on_outputs or (lambda outputs: None)
        self.host = host  # cores shared with other processes (``sim.host``), if any
        self.threads = threads
        self.fast_forward = fast_forward  # runs of decode-only steps at once; False: every step the engine's
        self._busy_s = 0.0
        self._stepping = False
        self._run: DecodeRun | None = None
        self._added = False  # a request came since the engine's last step: the next step is the engine's
        if engine.runner.tier_io is not None:  # a disk tier's or shared store's call landed
            engine.runner.tier_io.on_event = self.wake

    @property
    def engine(self) -> LLMEngine:
        self._catch_up()
        return self._engine

    @property
    def busy_s(self) -> float:
        self._catch_up()
        return self._busy_s

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, **options) -> None:
        """``LLMEngine.add_request`` now; it runs from the next step."""
        self._interrupt()
        self._engine.add_request(request_id, prompt, params, **options)
        self._added = True
        self.wake()

    def wake(self) -> None:
        """Step now unless a step is under way (new work, a finished read, a notice)."""
        self._interrupt()
        if not self._stepping:
            self._step()

    def _step(self) -> None:
        if self.fast_forward and self.host is None and not self._added and self._start_run():
            return
        engine = self._engine
        steps_before = engine.runner.num_steps
        results = engine.step()
        self._added = False
        ran = engine.runner.num_steps > steps_before
        if not ran and not results:
            self._stepping = False  # idle, or nothing schedulable now: the next arrival or notice wakes it
            return
        seconds = engine.runner.last_step_seconds if ran else 0.0
        if ran and self.host is not None:
            seconds *= self.host.begin(self.replica_id, engine.runner.last_step_threads or self.threads)
        self._busy_s += seconds
        self._stepping = True
        self.loop.at(self.loop.now + seconds, lambda: self._land(results))

    def _land(self, results: list[RequestOutput]) -> None:
        if self.host is not None:
            self.host.end(self.replica_id)
        if results:
            self.on_outputs(results)
        self._step()

    # Fast-forwarded runs (sim.fast_forward) ----------------------------------------

    def _start_run(self) -> bool:
        num_steps = run_length(self._engine)
        if num_steps == 0:
            return False
        run = self._run = DecodeRun(self._engine, self.loop.now, num_steps)
        self._stepping = True
        self.loop.at(run.ends_s[-1], lambda: self._end_run(run, num_steps))
        return True

    def _end_run(self, run: DecodeRun, num_steps: int) -> None:
        if run is not self._run or run.num_steps != num_steps:
            return  # cut short: its own end comes earlier
        self._apply(run.num_steps)
        self._run = None
        self._step()

    def _catch_up(self) -> None:
        """Apply the steps of the run begun by now (as stepping has them applied at their start)."""
        if self._run is not None:
            self._apply(self._run.num_begun(self.loop.now))

    def _interrupt(self) -> None:
        """Something reaches the engine mid-run: the run ends with the step in progress."""
        run = self._run
        if run is None:
            return
        num_begun = run.num_begun(self.loop.now)
        self._apply(num_begun)
        if num_begun < run.num_steps:
            run.truncate(num_begun)
            self.loop.at(run.ends_s[-1], lambda: self._end_run(run, num_begun))

    def _apply(self, upto: int) -> None:
        run = self._run
        first = run.num_applied
        outputs = run.apply(self._engine, upto)
        if outputs is not None:
            for seconds in run.seconds[first:upto]:
                self._busy_s += seconds
            self.on_outputs(outputs)


def replay(trace: Sequence[TraceRequest], engine: LLMEngine, block_tokens: int,
           fast_forward: bool = True) -> list[RequestRecord]:
    """Serve ``trace`` (arrival times as recorded) on one replica; the records in trace order."""
    loop = EventLoop()
    records: dict[str, RequestRecord] = {}

    def land(results: list[RequestOutput] | RunOutputs) -> None:
        if isinstance(results, RunOutputs):
            for request_id, times_s in results.token_times():
                records[request_id].token_times_s += times_s
            return
        for result in results:
            records[result.request_id].add(result, loop.now)

    replica = SimReplica(loop, engine, on_outputs=land, fast_forward=fast_forward)
    for index, request in enumerate(trace):
        prompt = trace_prompt_token_ids(request, block_tokens, engine.model_config.vocab_size)
        max_tokens = scaled(request.output_length, block_tokens) if request.output_length else 1

        def arrive(request_id=f"r{index}", prompt=prompt, max_tokens=max_tokens):
            records[request_id] = RequestRecord(loop.now, len(prompt))
            replica.add(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

        loop.at(request.timestamp_ms / 1000, arrive)
    loop.run()
    return [records[f"r{index}"] for index in range(len(trace))]


def summarize(records: Sequence[RequestRecord]) -> dict:
    """Latency percentiles (seconds) and throughput of finished requests."""
    done = [r for r in records if r.finished_s is not None]
    itls = [gap for r in done for gap in r.itls_s()]
    span = max(r.finished_s for r in done) - min(r.arrival_s for r in done) if done else 0.0
    return {
        "requests": len(records), "finished": len(done),
        "ttft_p50_s": percentile([r.ttft_s for r in done], 50), "ttft_p90_s": percentile([r.ttft_s for r in done], 90),
        "itl_p50_s": percentile(itls, 50) if itls else None, "itl_p90_s": percentile(itls, 90) if itls else None,
        "e2e_p50_s": percentile([r.e2e_s for r in done], 50),
        "output_tokens_per_s": sum(len(r.token_times_s) for r in done) / span if span else None,
        "prefix_hit_tokens": sum(r.num_cached_tokens for r in done),
    }
