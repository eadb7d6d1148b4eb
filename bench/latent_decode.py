"""MLA decode attention on the CPU against the host's memory and compute limits: ``python -m bench.latent_decode``.

``python -m bench.latent_decode [--context 4096] [--heads 16 128] [--batch 1 8 32] [--pages fp32 bf16]
[--threads 1 2] [--repeats 11]``

For each (page type, thread count, query heads, batch) it times one layer's decode step through ``latent_decode.cpp``
(fp32 queries, the kernel the cpu backend's ``latent_attention`` runs for decode rows): ``batch``
sequences of ``context`` tokens of DeepSeek-V3's latent rows (576 = kv_lora_rank 512 + rope 64, the
value its first 512), each call's pages at random blocks of a pool of at least ``POOL_BYTES``, so
that they are read from memory, as a step reads each layer's. Alternating with each call, the same
run times a sum and a copy of ``STREAM_BYTES`` (the stream bandwidth: the faster, a copy counting
read plus write), an fp32 matmul of ``MATMUL_SIZE`` (the multiply-add peak) and a parallel region
with next to no work (``wake_ms``: what starting the threads costs now), on the same threads.

One JSON object, with per case: medians in ms (``ours_ms``); ``pages_gb_s``, the pages read per second, and
``frac_of_stream``, that over the stream bandwidth (the target: 0.7 on 2 threads); ``gflop_s``
and ``frac_of_matmul`` against the matmul; and ``bound_over_ours``, the larger of the two limits'
times over ours (1.0: at the roofline). Every head multiplies each 576-value row, scores and values,
so 16 heads do 16 x 1,088 x 2 FLOPs per row of 1,152 (bf16) or 2,304 (fp32) bytes: where that is
more than the host's matmul FLOP/s over its stream bytes/s, the multiply-adds bound the kernel, not
the memory. ``max_abs_error``: the first sequence against the torch reference. Where ``wake_ms`` is
milliseconds, other work on the host holds the cores (``loadavg``) and every time at that thread count
is the scheduler's, not the kernel's: compare the one-thread figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import pd_kernels.cpu
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile
from pd_kernels import reference

LATENT_DIM, V_DIM, BLOCK = 576, 512, 16
PAGES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The pool each case's pages are drawn from, at least twice the batch's: past the host's last-level
# cache (300 MiB on the VMs this was written on), so that pages come from memory.
POOL_BYTES = 768 * 1024**2
# The stream tensors (a sum reads one, a copy reads it and writes another) and the matmul's side.
STREAM_BYTES = 512 * 1024**2
MATMUL_SIZE = 2048
# The parallel region that measures waking the threads: an exp over this many floats (microseconds).
WAKE_NUMEL = 1 << 16


def stream_forms() -> dict:
    """Calls that move a known number of bytes: ``{name: (call, bytes moved)}``."""
    src = torch.ones(STREAM_BYTES // 4)
    dst = torch.empty_like(src)
    return {"sum": (src.sum, STREAM_BYTES), "copy": (lambda: dst.copy_(src), 2 * STREAM_BYTES)}


def make_pool(dtype: torch.dtype, max_pages: int) -> torch.Tensor:
    """``[num_blocks, BLOCK, 1, LATENT_DIM]`` random latent rows of ``dtype``, of ``POOL_BYTES`` or twice
    ``max_pages`` blocks, whichever is more."""
    block_bytes = BLOCK * LATENT_DIM * dtype.itemsize
    num_blocks = max(2 * max_pages, POOL_BYTES // block_bytes)
    return torch.randn(num_blocks, BLOCK, 1, LATENT_DIM, generator=torch.Generator().manual_seed(0), dtype=dtype)


def bench_case(pool: torch.Tensor, heads: int, batch: int, context: int, repeats: int, limits: dict) -> dict:
    generator = torch.Generator().manual_seed(1)
    pages = -(-context // BLOCK)
    # A table per call: each call reads other blocks than the last, as each layer of a step does.
    tables = [torch.randperm(pool.shape[0], generator=generator)[:batch * pages].view(batch, pages).int()
              for _ in range(repeats + 1)]
    q = torch.randn(batch, heads, LATENT_DIM, generator=generator)
    out = torch.empty(batch, heads, V_DIM)
    lens = torch.full((batch,), context, dtype=torch.int32)
    rows, scale = torch.arange(batch), LATENT_DIM**-0.5
    kernel = pd_kernels.cpu.build().latent_decode_attention
    calls = iter(tables)
    forms = {"ours": lambda: kernel(q, pool, next(calls), lens, rows, scale, 1.0, out), **limits}
    times = {name: [] for name in forms}
    for _ in range(repeats + 1):  # alternating, so a slow moment of the host falls on every form alike
        for name, call in forms.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    median = {name: percentile(samples[1:], 50) for name, samples in times.items()}
    table = tables[-1]
    expected = reference.latent_attention(q[:1], pool, torch.tensor([0, 1], dtype=torch.int32), lens[:1], table[:1],
                                          scale, v_dim=V_DIM)
    error = (out[:1] - expected).abs().max().item()
    page_bytes = batch * context * LATENT_DIM * pool.dtype.itemsize
    flops = 2 * batch * context * heads * (LATENT_DIM + V_DIM)
    stream = max(STREAM_BYTES / median["sum"], 2 * STREAM_BYTES / median["copy"])
    matmul = 2 * MATMUL_SIZE**3 / median["matmul"]
    ours = median["ours"]
    bound = max(page_bytes / stream, flops / matmul)
    return {
        "threads": torch.get_num_threads(), "heads": heads, "pages": str(pool.dtype).removeprefix("torch."), "batch": batch, "context": context,
        "ours_ms": round(ours * 1e3, 3), "pages_gb_s": round(page_bytes / ours / 1e9, 2),
        "stream_gb_s": round(stream / 1e9, 2), "frac_of_stream": round(page_bytes / ours / stream, 3),
        "gflop_s": round(flops / ours / 1e9, 1), "matmul_gflop_s": round(matmul / 1e9, 1),
        "frac_of_matmul": round(flops / ours / matmul, 3), "bound_ms": round(bound * 1e3, 3),
        "bound_over_ours": round(bound / ours, 3), "wake_ms": round(median["wake"] * 1e3, 3),
        "max_abs_error": error,
    }


def bench(context: int, heads_list: list[int], batches: list[int], page_types: list[str], threads_list: list[int],
          repeats: int) -> dict:
    pd_kernels.cpu.build()
    a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    small = torch.ones(WAKE_NUMEL)
    limits = {name: call for name, (call, _) in stream_forms().items()}
    limits["matmul"] = lambda: torch.mm(a, b)
    limits["wake"] = small.exp
    loadavg = os.getloadavg()[0]
    results = []
    for kind in page_types:
        pool = make_pool(PAGES[kind], max(batches) * -(-context // BLOCK))
        for threads in threads_list:
            torch.set_num_threads(threads)
            for heads in heads_list:
                for batch in batches:
                    results.append(bench_case(pool, heads, batch, context, repeats, limits))
        del pool
    return {
        "case": "latent_decode", "cpu": cpu_name(), "cpu_flags": cpu_flags(), "isa": pd_kernels.cpu.isa(),
        "loadavg": [round(loadavg, 2), round(os.getloadavg()[0], 2)], "context": context, "latent_dim": LATENT_DIM,
        "v_dim": V_DIM, "block_size": BLOCK, "repeats": repeats, "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--pages", choices=tuple(PAGES), nargs="+", default=list(PAGES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)
    print(json.dumps(bench(args.context, args.heads, args.batch, args.pages, args.threads, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
