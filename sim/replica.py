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
    that made them, in the engine's order. ``busy_s`` adds up the modelled time of the steps run.
    """

    def __init__(self, loop: EventLoop, engine: LLMEngine, replica_id: str = "replica",
                 on_outputs: Callable[[list[RequestOutput]], None] | None = None, host: SharedHost | None = None,
                 threads: int = 1):
        self.loop = loop
        self.engine = engine
        self.replica_id = replica_id
        self.on_outputs = on_outputs or (lambda outputs: None)
        self.host = host  # cores shared with other processes (``sim.host``), if any
        self.threads = threads
        self.busy_s = 0.0
        self._stepping = False
        if engine.runner.tier_io is not None:  # a disk tier's or shared store's call landed
            engine.runner.tier_io.on_event = self.wake

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, **options) -> None:
        """``LLMEngine.add_request`` now; it runs from the next step."""
        self.engine.add_request(request_id, prompt, params, **options)
        self.wake()

    def wake(self) -> None:
        """Step now unless a step is under way (new work, a finished read, a notice)."""
        if not self._stepping:
            self._step()

    def _step(self) -> None:
        steps_before = self.engine.runner.num_steps
        results = self.engine.step()
        ran = self.engine.runner.num_steps > steps_before
        if not ran and not results:
            self._stepping = False  # idle, or nothing schedulable now: the next arrival or notice wakes it
            return
        seconds = self.engine.runner.last_step_seconds if ran else 0.0
        if ran and self.host is not None:
            seconds *= self.host.begin(self.replica_id, self.engine.runner.last_step_threads or self.threads)
        self.busy_s += seconds
        self._stepping = True
        self.loop.at(self.loop.now + seconds, lambda: self._land(results))

    def _land(self, results: list[RequestOutput]) -> None:
        if self.host is not None:
            self.host.end(self.replica_id)
        if results:
            self.on_outputs(results)
        self._step()


def replay(trace: Sequence[TraceRequest], engine: LLMEngine, block_tokens: int) -> list[RequestRecord]:
    """Serve ``trace`` (arrival times as recorded) on one replica; the records in trace order."""
    loop = EventLoop()
    records: dict[str, RequestRecord] = {}

    def land(results: list[RequestOutput]) -> None:
        for result in results:
            records[result.request_id].add(result, loop.now)

    replica = SimReplica(loop, engine, on_outputs=land)
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
