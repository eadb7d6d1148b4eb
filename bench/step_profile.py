"""Where an engine step's time goes, on ``bench.engine``'s mixed workload.

``python -m bench.step_profile [--model small] [--case mixed] [--threads 2]``
runs the workload once to warm up, then once timed, with a wall-clock timer
around each part of the step, and prints one JSON object: the share of step
time per part, the number of steps and the median step time.

Parts are timed where the engine calls them (nested parts are subtracted from
the part around them, so the shares add up to 1):

- ``dense``: every ``Linear`` (QKV, o_proj, gate/up, down, LM head);
- ``attention``: ``pd_kernels.unified_attention``, less the gathers inside it;
- ``gather``: ``pd_kernels.reference._gather_pages``, copying pages out of the pool;
- ``kv_store``, ``norms``, ``rotary``: those kernels;
- ``prepare``: flattening the schedule into tensors; ``sampling``;
- ``other``: the rest of the step (scheduling, embedding, SiLU and mul, outputs).

The timers add a few microseconds per call, so absolute step times read a
little high; compare shares of runs measured the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import pd.model.linear
import pd.model.llama
import pd_kernels
import pd_kernels.reference
from bench.engine import MODELS, make_checkpoint, run_ours
from pd import LLM
from pd.workload.host import cpu_name
from pd.workload.stats import percentile
from pd.workload.token_prompts import token_batch

PARTS = ("dense", "attention", "gather", "kv_store", "norms", "rotary", "prepare", "sampling", "other")


class Timers:
    """Exclusive wall time per part: a nested part's time is taken out of its parent's."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []

    @contextlib.contextmanager
    def part(self, name: str):
        frame = [name, time.perf_counter(), 0.0]  # name, start, time spent in children
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[1]
            self.totals[name] += elapsed - frame[2]
            if self._stack:
                self._stack[-1][2] += elapsed


def wrap(timers: Timers, name: str, fn):
    def timed(*args, **kwargs):
        with timers.part(name):
            return fn(*args, **kwargs)
    return timed


def instrument(timers: Timers, llm: LLM) -> None:
    """Put a timer around each part, where the engine looks it up."""
    kernels_module = pd.model.llama.pd_kernels
    for attr, name in (("unified_attention", "attention"), ("store_kv", "kv_store"), ("rms_norm", "norms"),
                       ("rotary_embedding", "rotary")):
        setattr(kernels_module, attr, wrap(timers, name, getattr(pd_kernels, attr)))
    pd_kernels.reference._gather_pages = wrap(timers, "gather", pd_kernels.reference._gather_pages)
    pd.model.linear.Linear.__call__ = wrap(timers, "dense", pd.model.linear.Linear.__call__)
    runner = llm.engine.runner
    runner.prepare = wrap(timers, "prepare", runner.prepare)
    runner.sampler.sample = wrap(timers, "sampling", runner.sampler.sample)
    step = llm.engine.step
    step_times: list[float] = []

    def timed_step():
        start = time.perf_counter()
        with timers.part("other"):
            result = step()
        step_times.append(time.perf_counter() - start)
        return result

    llm.engine.step = timed_step
    timers.step_times = step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--case", default="mixed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="the engine's attention_backend")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        path = make_checkpoint(args.model, Path(root))
        llm = LLM(str(path), dtype="float32", kv_cache_bytes=1024**3, attention_backend=args.backend)
        vocab = MODELS[args.model]["vocab_size"]
        run_ours(llm, token_batch(args.case, vocab, seed=1000))
        timers = Timers()
        instrument(timers, llm)
        run_ours(llm, token_batch(args.case, vocab, seed=1))
    total = sum(timers.totals.values())
    print(json.dumps({
        "model": args.model, "case": args.case, "threads": args.threads, "cpu": cpu_name(),
        "backend": llm.engine.runner.backend, "steps": len(timers.step_times),
        "median_step_ms": round(1e3 * percentile(timers.step_times, 50), 2),
        "share": {part: round(timers.totals.get(part, 0.0) / total, 3) for part in PARTS},
    }))


if __name__ == "__main__":
    main()
