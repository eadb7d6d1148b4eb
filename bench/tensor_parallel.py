"""Tensor parallelism inside one engine: weights per rank, and throughput against one rank on the same cores.

``python -m bench.tensor_parallel [--repeats 3] [--sizes 1,2,4]``

On the ``small`` model of ``bench.engine`` (8 heads, 2 KV heads), one JSON
line per size: the weight bytes each rank holds (against one rank's whole
model), and, where the size fits the machine's cores, useful tokens per
second against TP=1 on the same total threads (``num_threads`` cores split
evenly across the ranks), medians of alternating repeats, with how many
greedy outputs equal TP=1's. On CPU, TP shows what it costs (an all-reduce
per row-parallel layer over loopback gloo), not what it buys: on GPUs it
buys memory and bandwidth per device.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import make_checkpoint
from pd import LLM, SamplingParams
from pd.workload.host import cpu_name
from pd.workload.stats import percentile


def workload(num_requests: int, prompt_len: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 32000, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]


def timed_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def weight_bytes(path: Path, size: int) -> list[int]:
    with LLM(str(path), num_blocks=16, tensor_parallel_size=size, num_threads=1) as llm:
        return [rank["weight_bytes"] for rank in llm.engine.tp_ranks()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    prompts = workload(args.requests, args.prompt_len)
    useful = args.requests * args.max_tokens
    with tempfile.TemporaryDirectory() as root:
        path = make_checkpoint("small", Path(root))
        whole = weight_bytes(path, 1)[0]
        timed = sorted({1, *(s for s in sizes if s <= args.threads)})
        engines = {s: LLM(str(path), kv_cache_bytes=256 * 1024**2, tensor_parallel_size=s,
                          num_threads=max(1, args.threads // s)) for s in timed}
        try:
            for llm in engines.values():
                timed_run(llm, prompts[:2], 4)  # warm: oneDNN kernels, first allocations
            seconds = {s: [] for s in timed}
            tokens = {}
            for _ in range(args.repeats):
                for size, llm in engines.items():
                    elapsed, tokens[size] = timed_run(llm, prompts, args.max_tokens)
                    seconds[size].append(elapsed)
        finally:
            for llm in engines.values():
                llm.close()
        for size in sizes:
            per_rank = weight_bytes(path, size) if size > 1 else [whole]
            line = {"bench": "tensor_parallel", "cpu": cpu_name(), "model": "small", "tensor_parallel_size": size,
                    "weight_bytes_per_rank": per_rank,
                    "max_rank_over_tp1": round(max(per_rank) / whole, 4)}
            if size in seconds:
                rate = useful / percentile(seconds[size], 50)
                base = useful / percentile(seconds[timed[0]], 50)
                line.update(threads_per_rank=max(1, args.threads // size), useful_tok_s=round(rate, 1),
                            over_tp1=round(rate / base, 3),
                            outputs_equal_tp1=sum(a == b for a, b in zip(tokens[size], tokens[timed[0]])),
                            num_outputs=len(prompts))
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
