"""Every device-to-host sync on a step's CUDA path, counted where it happens (CUDA only).

``python -m bench.step_syncs [--layers 4] [--steps 20]`` runs our engine on a small random Llama in bf16
on the GPU (CUDA graphs on), synchronously and with async scheduling, to a steady state, then runs
``--steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")`` and records each synchronizing call's
Python location. Two workloads: pure decode (greedy), and mixed (decode rows beside a chunked prefill,
unseeded sampled rows drawn together, a seeded sampled request asking for logprobs and one asking for
prompt logprobs).

A step should sync once: the wait in ``pd.engine.readback.DeviceSamples.read`` for its sampled ids
(and the log-probabilities asked for, copied with them). Prints one JSON line per (workload, mode):
``syncs_per_step``, ``sites`` (``file:line`` -> count; anything but the read is a sync to remove),
``unexpected`` (the sites outside ``readback.py``) and ``ok``. Without CUDA it prints a line saying it
was skipped.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.sampling_params import SamplingParams

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=2048)
EXPECTED_FILE = "readback.py"
ROOT = Path(__file__).resolve().parent.parent
ENGINE_PACKAGES = ("pd", "pd_kernels")


def make_checkpoint(root: Path, layers: int, shape: dict | None = None, device: str = "cuda") -> Path:
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, initializer_range=0.02,
                                                                       **(shape or SHAPE)))
    path = root / "llama"
    model.to(torch.bfloat16).eval().save_pretrained(path)
    return path


def add_requests(engine: LLMEngine, workload: str, batch: int) -> None:
    greedy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"d{index}", [(index * 13 + i) % 30000 + 1 for i in range(32)], greedy)
    if workload == "mixed":
        for index in range(4):  # drawn together (``Sampler._draw_together``), each with its own parameters
            engine.add_request(f"s{index}", [(index * 17 + i) % 30000 + 1 for i in range(24)], SamplingParams(
                max_tokens=200, temperature=0.6 + 0.1 * index, top_p=0.95, top_k=40 if index % 2 else None,
                ignore_eos=True))
        engine.add_request("seeded", list(range(1, 40)), SamplingParams(
            max_tokens=200, temperature=0.8, top_p=0.9, top_k=50, seed=1, logprobs=3, ignore_eos=True))
        engine.add_request("scored", list(range(5, 45)), SamplingParams(max_tokens=200, temperature=0, prompt_logprobs=2,
                                                                        logprobs=0, ignore_eos=True))


def sync_site(filename: str, lineno: int, stack: list[traceback.FrameSummary] | None = None) -> str:
    """Where a sync warned from: the innermost frame of the engine's own code (``pd``, ``pd_kernels``) as
    ``file:line``, then the warning's own location (often torch's) after ``via``."""
    frames = stack if stack is not None else traceback.extract_stack()
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(ROOT)
            and Path(f.filename).resolve().relative_to(ROOT).parts[0] in ENGINE_PACKAGES]
    where = f"{Path(filename).name}:{lineno}"
    if not ours:
        return where
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno} via {where}"


def count_syncs(path: Path, workload: str, ahead: bool, args, device: str = "cuda") -> dict:
    """The syncs of ``args.steps`` steps of ``workload``. On a CPU (for a test of the workload itself) the
    steps run with nothing to count."""
    engine = LLMEngine(EngineConfig(model=str(path), device=device, dtype="bfloat16", num_blocks=4096,
                                    max_num_batched_tokens=256, max_model_len=1024, max_num_seqs=args.batch + 16,
                                    async_scheduling=ahead))
    engine.warm_up()
    add_requests(engine, workload, args.batch)
    for _ in range(20):  # the decode rows reach a steady state; their prompts are in
        engine.step()
    if workload == "mixed":  # a long prompt arrives: its chunks share the measured steps with the decodes
        engine.add_request("long", [(7 * i) % 30000 + 1 for i in range(900)],
                           SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    sites: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, *rest: sites.update(
            [sync_site(filename, lineno)] if "synchroniz" in str(message) else [])
        counting = device == "cuda"
        if counting:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(args.steps):
                engine.step()
        finally:
            if counting:
                torch.cuda.set_sync_debug_mode("default")
    engine.close()
    unexpected = {site: n for site, n in sites.items() if not site.startswith(EXPECTED_FILE)}
    return {"workload": workload, "mode": "async" if ahead else "sync", "steps": args.steps,
            "syncs_per_step": round(sum(sites.values()) / args.steps, 3), "sites": dict(sites),
            "unexpected": unexpected, "ok": not unexpected,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    with tempfile.TemporaryDirectory() as root:
        path = make_checkpoint(Path(root), args.layers)
        for workload in ("decode", "mixed"):
            for ahead in (False, True):
                print(json.dumps(count_syncs(path, workload, ahead, args)), flush=True)


if __name__ == "__main__":
    main()
