"""One engine replica in simulated time: the real scheduler, with the forward pass replaced by its cost.

``SimEngine.step`` is ``LLMEngine.step`` with the model taken out: the real
``Scheduler`` schedules (admission, chunked prefill, prefix-cache hits,
preemption), ``CostModel`` says how long the batch takes, and the real
``Scheduler.update`` advances every request and caches its blocks. Sampled
tokens are drawn from a seeded generator; requests end at their
``max_tokens`` (``ignore_eos``), as a trace's output lengths say.
"""

from __future__ import annotations

import random

from pd.config import SchedulerConfig
from pd.engine.outputs import ForwardOutput, RequestOutput
from pd.engine.request import Request
from pd.engine.scheduler import make_scheduler
from pd.sampling_params import SamplingParams
from sim.cost import CostModel, StepShape


class SimEngine:
    def __init__(self, config: SchedulerConfig, cost: CostModel, vocab_size: int, seed: int = 0):
        self.config = config
        self.cost = cost
        self.vocab_size = vocab_size
        self.scheduler = make_scheduler(config)
        self._tokens = random.Random(seed)
        self.num_steps = 0

    def add(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> Request:
        request = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.scheduler.add(request)
        return request

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> tuple[float, list[RequestOutput]]:
        """``(seconds the step takes, its outputs)``; ``(0, [])`` when nothing could be scheduled."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return 0.0, []
        seconds = self.cost.step_seconds(StepShape.of(out.scheduled))
        sampled = [self._tokens.randrange(self.vocab_size) for item in out.scheduled if item.samples]
        results = self.scheduler.update(out, ForwardOutput(sampled_token_ids=sampled, logprobs=None))
        self.num_steps += 1
        return seconds, results
