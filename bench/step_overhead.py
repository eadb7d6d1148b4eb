"""The host's share of a decode step, and how much of it the device waits for: synchronous against async
scheduling (``EngineConfig.async_scheduling``, ``pd.engine.overlap``), in the same run.

``python -m bench.step_overhead [--batches 32,128,256] [--steps 100] [--threads 1] [--temperature T]
[--top-p P]`` runs the real engine on a tiny random-weight Llama on the CPU: ``batch`` requests of
16-token prompts (greedy, or sampled at ``T`` and ``P``, unseeded), prefilled, then
``--steps`` decode steps measured, every request decoding in each. Each step's wall time is split by
timers around its phases (``poll``, ``schedule``, ``flatten``, ``to_device``, ``forward``, ``sample``,
``read``, ``update``, ``other``: the rest of ``LLMEngine.step``). The host's time is all of it but
``forward``, the model's own forward pass; per step, median over the steps.

On the CPU the forward runs on the host itself, so no overlap can shorten a step here; what async
scheduling changes is where the host's work sits. ``exposed_ms_per_step`` is the part the device would
wait for: synchronously, all of it (the device is idle from the end of step N until step N+1 is
launched, and the host works in between); with async scheduling, a step's host work runs while the
step before it is on the device, so only what exceeds a device step of ``--device-step-ms`` (4 ms, the
issue's H200 decode step) is exposed, and all of it for a step that had to read the one before first.
The issue's target is exposed <= 10% of that step at batch 32 and 128.

``--device cuda --model llama3-8b`` (the lead's run on a GPU) measures the device itself instead:
CUDA events around each step's device work give its busy time (``device_ms_per_step``) and the idle gap
between steps (``exposed_ms_per_step``: what the device really waited for the host), beside the step
period (``period_ms``, wall time per step) and the tokens/s it gives.

Prints one JSON line per (batch, mode), then one per batch comparing the modes, each naming the CPU
and its ISA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

import pd.engine.model_runner
import pd.engine.readback
import pd_kernels.cpu
from bench.timing import DeviceTimer
from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.engine.reports import uncomputed_prompt_tokens
from pd.sampling_params import SamplingParams
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
PROMPT_LEN = 16
WARM_UP_STEPS = 5
PHASES = ("poll", "schedule", "flatten", "to_device", "forward", "sample", "read", "update")
TARGET_SHARE = 0.10  # of the device step: the bound on the exposed host time


def make_checkpoint(root: Path, model: str, layers: int | None, device: str) -> Path:
    import transformers

    shape = dict(TINY if model == "tiny" else LLAMA3_8B)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(initializer_range=0.02, **shape))
    path = root / model
    hf.to(torch.bfloat16 if device == "cuda" else torch.float32).eval().save_pretrained(path)
    return path


class StepTimers:
    """Wall time per phase within the current step, wrapped around the engine's own objects."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - started

        self.wrapped.append((owner, name, fn))
        setattr(owner, name, timed)

    def restore(self) -> None:
        """Put back what ``wrap`` replaced (a module's functions outlive the engine timed)."""
        for owner, name, fn in reversed(self.wrapped):
            setattr(owner, name, fn)
        self.wrapped.clear()

    def take(self) -> dict[str, float]:
        taken, self.current = dict(self.current), defaultdict(float)
        return taken


@dataclass
class MeasuredSteps:
    """The timed steps: (wall seconds, seconds per phase) each, the tokens they emitted, and whether each
    one's host work ran beside a forward on the device."""

    records: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    num_tokens: int = 0
    covered: list[bool] = field(default_factory=list)


def run_case(path: Path, batch: int, ahead: bool, args) -> dict:
    max_tokens = WARM_UP_STEPS + args.steps + 8
    engine = make_engine(path, batch, ahead, max_tokens, args.device)
    prefill(engine, batch, max_tokens, args.temperature, args.top_p)
    timers = time_phases(engine)
    gaps = DeviceTimer(engine.runner) if args.device == "cuda" else None
    try:
        measured = measure_steps(engine, timers, args.steps)
    finally:
        timers.restore()
    row = {
        "batch": batch, "mode": "async" if ahead else "sync", "device": args.device, "model": args.model,
        "temperature": args.temperature, "top_p": args.top_p,
        "steps": args.steps, **host_figures(measured, args.device_step_ms / 1e3),
        "steps_launched_ahead": engine.pipeline.num_launched_ahead if engine.pipeline else 0,
        "phases_ms": phase_breakdown(measured.records),
    }
    if gaps is not None:
        busy_ms, gap_ms = gaps.summary(WARM_UP_STEPS)
        row.update(device_ms_per_step=round(busy_ms, 4), exposed_ms_per_step=round(gap_ms, 4))
        row.pop("forward_ms_per_step")  # a graph's replay returns at once: the device's time is busy_ms
        row["host_ms_per_step"] = round(1e3 * percentile([w - p.get("read", 0.0) for w, p in measured.records], 50), 4)
    engine.close()
    return row


def make_engine(path: Path, batch: int, ahead: bool, max_tokens: int, device: str) -> LLMEngine:
    """An engine with room for ``batch`` requests of ``max_tokens`` tokens each, warmed up."""
    blocks_each = -(-(PROMPT_LEN + max_tokens) // 16)
    config = EngineConfig(model=str(path), device=device, dtype="bfloat16" if device == "cuda" else "float32",
                          num_blocks=batch * blocks_each + 16, max_num_seqs=batch,
                          max_num_batched_tokens=max(2048, batch * PROMPT_LEN), async_scheduling=ahead,
                          max_model_len=PROMPT_LEN + max_tokens + 16)
    engine = LLMEngine(config)
    engine.warm_up()
    return engine


def prefill(engine: LLMEngine, batch: int, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0) -> None:
    """Add ``batch`` requests and step until every prompt is in: the steps after decode only."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"r{index}", [(index * 31 + i * 7) % 500 + 1 for i in range(PROMPT_LEN)], params)
    while uncomputed_prompt_tokens(engine.scheduler) or engine.scheduler.waiting:
        engine.step()


def time_phases(engine: LLMEngine) -> StepTimers:
    """Timers around the engine's phases (but ``read``: see ``_timed_reads``)."""
    timers = StepTimers()
    timers.wrap(engine, "poll_transfers", "poll")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "update", "update")
    # A step's inputs are built by functions of ``pd.engine.step_inputs``: timed under the names the runner
    # calls them by (restored in ``run_case``).
    timers.wrap(pd.engine.model_runner, "flatten", "flatten")
    timers.wrap(pd.engine.model_runner, "to_device", "to_device")
    timers.wrap(engine.runner.model, "forward", "forward")
    timers.wrap(engine.runner.sampler, "draw", "sample")
    return timers


def measure_steps(engine: LLMEngine, timers: StepTimers, steps: int) -> MeasuredSteps:
    """``WARM_UP_STEPS`` untimed steps, then ``steps`` timed ones, every request decoding in each."""
    measured = MeasuredSteps()
    with _timed_reads(timers):
        for step in range(WARM_UP_STEPS + steps):
            in_flight_before = engine.step_in_flight
            started = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - started
            phases = timers.take()
            if step >= WARM_UP_STEPS:
                measured.num_tokens += sum(len(o.new_token_ids) for o in outputs)
                measured.records.append((wall, phases))
                # The step's host work ran beside a forward on the device: one was in flight when it
                # began, and it launched the next before reading that one.
                measured.covered.append(in_flight_before and engine.step_in_flight)
    assert all(len(o.new_token_ids) == 1 for o in outputs), "every measured step decodes every request"
    return measured


def host_figures(measured: MeasuredSteps, device_step_s: float) -> dict:
    """Medians per step, in ms: the host's time, the part of it the device waits for, the forward, the period."""
    walls = [wall for wall, _ in measured.records]
    forwards = [phases.get("forward", 0.0) for _, phases in measured.records]
    hosts = [wall - forward for wall, forward in zip(walls, forwards)]
    exposed = [max(0.0, host - device_step_s) if hidden else host for host, hidden in zip(hosts, measured.covered)]
    return {
        "host_ms_per_step": round(1e3 * percentile(hosts, 50), 4),
        "exposed_ms_per_step": round(1e3 * percentile(exposed, 50), 4),
        "forward_ms_per_step": round(1e3 * percentile(forwards, 50), 4),
        "period_ms": round(1e3 * percentile(walls, 50), 4), "tok_s": round(measured.num_tokens / sum(walls), 1),
    }


def phase_breakdown(records: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Each phase's median ms per step, and ``other``: the rest of the step's wall time."""
    breakdown = {phase: round(1e3 * percentile([p.get(phase, 0.0) for _, p in records], 50), 4) for phase in PHASES}
    others = [wall - sum(p.values()) for wall, p in records]
    breakdown["other"] = round(1e3 * percentile(others, 50), 4)
    return breakdown


@contextlib.contextmanager
def _timed_reads(timers: StepTimers):
    """Time ``DeviceSamples.read`` (the step's one wait for the device) as ``read``, for every instance."""
    cls = pd.engine.readback.DeviceSamples
    original = cls.read

    def read(self):
        started = time.perf_counter()
        try:
            return original(self)
        finally:
            timers.current["read"] += time.perf_counter() - started

    cls.read = read
    try:
        yield
    finally:
        cls.read = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="tiny", choices=("tiny", "llama3-8b"))
    parser.add_argument("--layers", type=int, default=None, help="the model's layers (default: its own)")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's")
    parser.add_argument("--device-step-ms", type=float, default=4.0,
                        help="CPU only: the device step the async engine's host work hides behind")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    torch.set_num_threads(args.threads)
    host = {"cpu": cpu_name(), "isa": pd_kernels.cpu.isa(), "cpu_flags": cpu_flags(), "threads": args.threads}
    if args.device == "cuda":
        host["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as root:
        path = make_checkpoint(Path(root), args.model, args.layers, args.device)
        for batch in (int(b) for b in args.batches.split(",")):
            rows = {}
            for ahead in (False, True):
                rows[ahead] = run_case(path, batch, ahead, args)
                print(json.dumps({**rows[ahead], **host}), flush=True)
            sync, ahead = rows[False], rows[True]
            target_ms = TARGET_SHARE * (args.device_step_ms if args.device == "cpu" else ahead["device_ms_per_step"])
            print(json.dumps({
                "batch": batch, "device": args.device, "host_ms_sync": sync["host_ms_per_step"],
                "host_ms_async": ahead["host_ms_per_step"], "exposed_ms_sync": sync["exposed_ms_per_step"],
                "exposed_ms_async": ahead["exposed_ms_per_step"], "target_exposed_ms": round(target_ms, 3),
                "meets_target": ahead["exposed_ms_per_step"] <= target_ms,
                "period_ratio_async_over_sync": round(ahead["period_ms"] / sync["period_ms"], 3), **host}),
                flush=True)


if __name__ == "__main__":
    main()
