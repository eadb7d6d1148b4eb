"""Measure the real engine's step times over a grid of batch shapes and fit ``sim.cost.CostModel``.

``python -m sim.profile [--model builtin:tiny-llama] [--threads 2] [--out sim-profile.json]``
runs ``LLMEngine`` on this machine: for each batch size and prompt length of
the grid, that many requests of that length arrive together and generate a
few tokens, so the steps cover prefill chunks, mixed batches and decodes at
several context lengths. Each ``step()`` is timed whole (scheduling and
bookkeeping included, which the simulator runs in zero simulated time) and
paired with the shape of what the scheduler put in it. It prints, and
writes, the fitted model with its median relative error over the measured
steps and the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pd.workload.host import cpu_name
from sim.cost import CostModel, StepShape

BATCH_SIZES = (1, 4, 16)
PROMPT_LENS = (32, 128, 512, 1024)
MAX_TOKENS = 8


def measure(model: str, threads: int | None, batch_sizes=BATCH_SIZES, prompt_lens=PROMPT_LENS,
            repeats: int = 2, **engine_options) -> tuple[list[StepShape], list[float]]:
    """``(shapes, seconds)`` of every step of the grid, after one unmeasured pass (first-call costs);
    ``engine_options``: more ``EngineConfig`` fields (``expert_parallel_size``: ranks of one thread each)."""
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, num_blocks=4096, num_threads=threads,
                                    max_num_batched_tokens=2048, **engine_options))
    try:
        return _measure(engine, batch_sizes, prompt_lens, repeats)
    finally:
        engine.close()


def _measure(engine, batch_sizes, prompt_lens, repeats: int) -> tuple[list[StepShape], list[float]]:
    from pd.sampling_params import SamplingParams

    scheduled = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(StepShape.of(out.scheduled))
        return out

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
    shapes, seconds, serial = [], [], 0
    for repeat in range(repeats + 1):
        for batch in batch_sizes:
            for length in prompt_lens:
                for _ in range(batch):  # distinct prompts: no prefix-cache hits
                    serial += 1
                    engine.add_request(f"p{serial}", [(serial * 7919 + i) % 1000 + 1 for i in range(length)], params)
                while engine.has_unfinished_requests():
                    scheduled.clear()
                    start = time.perf_counter()
                    engine.step()
                    elapsed = time.perf_counter() - start
                    if repeat > 0 and scheduled and scheduled[0].num_seqs:
                        shapes.append(scheduled[0])
                        seconds.append(elapsed)
    return shapes, seconds


def median_relative_error(model: CostModel, shapes, seconds) -> float:
    return statistics.median(abs(model.step_seconds(s) - t) / t for s, t in zip(shapes, seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="sim-profile.json")
    args = parser.parse_args()
    shapes, seconds = measure(args.model, args.threads)
    source = f"measured: {args.model}, {cpu_name()}, {args.threads} threads, {len(shapes)} steps"
    model = CostModel.fit(shapes, seconds, source)
    Path(args.out).write_text(model.to_json())
    print(json.dumps({"profile": json.loads(model.to_json()), "out": args.out,
                      "median_relative_error": round(median_relative_error(model, shapes, seconds), 3)}))


if __name__ == "__main__":
    main()
