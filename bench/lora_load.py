"""Loading a LoRA adapter while streams decode: what the load costs the streams, measured in the same run.

``python -m bench.lora_load [--streams 8] [--max-tokens 160] [--rank 16] [--threads 2]`` runs ``streams``
greedy requests on the served engine (``AsyncLLMEngine``, the trained default model with
``enable_lora``) and, once every stream has its first tokens, loads a new adapter
(``AsyncLLMEngine.load_lora``: the files read and checked on a worker thread, the adapter registered
between two steps), then sends one request under it. It prints one JSON line:

- ``itl_p99_s``: the streams' inter-token gaps before the load, their 99th percentile;
- ``step_s_p50``: the median gap there (a decode step);
- ``max_gap_during_load_s``: the longest gap of any stream from the load's start to its end;
- ``excess_over_p99_steps``: how far that gap passes ``itl_p99_s``, in steps (the issue's bound: 1);
- ``load_s``: the load's own time; ``new_adapter_ttft_s``: the first token under the new adapter, from
  the load's end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

from bench.lora_decode import MODEL, write_adapter
from pd.config import EngineConfig
from pd.engine.async_engine import AsyncLLMEngine
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.sampling_params import SamplingParams
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile


async def stream(engine: AsyncLLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
                 arrivals: list[float], lora: str | None = None) -> None:
    async with contextlib.aclosing(engine.add_request(request_id, prompt, params, lora=lora)) as outputs:
        async for out in outputs:
            arrivals.extend([time.perf_counter()] * len(out.new_token_ids))


async def run(args: argparse.Namespace, adapter: Path) -> dict:
    model_dir = resolve_model_path(args.model)
    vocab = load_model_config(model_dir).vocab_size
    engine = AsyncLLMEngine(EngineConfig(model=args.model, dtype="float32", num_threads=args.threads,
                                         enable_lora=True, max_lora_rank=args.rank))
    engine.warm_up()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    tasks = [asyncio.create_task(stream(engine, f"s{i}", [(31 * i + j) % (vocab - 1) + 1 for j in range(48)],
                                        params, arrivals[i])) for i in range(args.streams)]
    while min(len(a) for a in arrivals) < args.max_tokens // 3:
        await asyncio.sleep(0.01)
    load_start = time.perf_counter()
    await engine.load_lora("new", str(adapter))
    load_end = time.perf_counter()
    first: list[float] = []
    await stream(engine, "new", [5, 6, 7, 8] * 8, SamplingParams(max_tokens=1, temperature=0), first, lora="new")
    await asyncio.gather(*tasks)
    await engine.shutdown()
    before = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b < load_start and b - a > 0]
    during = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b > load_start and a < load_end]
    p99, step = percentile(before, 99), percentile(before, 50)
    worst = max(during, default=0.0)
    return {"bench": "lora_load", "streams": args.streams, "rank": args.rank, "itl_p99_s": round(p99, 5),
            "step_s_p50": round(step, 5), "max_gap_during_load_s": round(worst, 5),
            "excess_over_p99_steps": round(max(0.0, worst - p99) / step, 2), "load_s": round(load_end - load_start, 4),
            "new_adapter_ttft_s": round(first[0] - load_end, 4), "model": args.model, "threads": args.threads,
            "cpu": cpu_name(), "cpu_flags": cpu_flags()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        adapter = write_adapter(resolve_model_path(args.model), Path(root) / "new", args.rank, seed=7)
        print(json.dumps(asyncio.run(run(args, adapter))), flush=True)


if __name__ == "__main__":
    main()
