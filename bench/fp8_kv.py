"""FP8 KV against bf16 and fp32 KV: decode attention speed, and the bytes a remote prefill moves.

``python -m bench.fp8_kv [--context 4096] [--batch 8] [--threads 2] [--repeats 21] [--model builtin:tiny-llama]``

1. ``decode_attention``: one layer's decode step of ``--batch`` sequences of ``--context`` tokens each,
   in SmolLM2-135M's and Llama-3-8B's attention shapes, through the C++ kernel (fp32 queries) over
   pools of fp32, bf16, float8_e4m3fn and float8_e5m2 pages (the same call, converting rows to fp32 in L1), each sequence's pages at random blocks of
   a pool larger than the caches. Times alternate between the page types; one JSON line per shape
   with medians in ms, each type's ratio to bf16 pages, its KV GB/s against the copy bandwidth measured
   in the same run (the step's physical limit), and ``bf16_queries``: a bf16 model's call, through
   ``pd_kernels.unified_attention`` (its queries made fp32 for the same kernel, and its output back).
2. ``transfer``: a remote prefill between two engines in this process over NIXL, bf16 pages against
   FP8 ones of the same model: the bytes NIXL's telemetry says the decode engine's reads moved.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import pd_kernels
import pd_kernels.cpu
from bench.engine import measure_peaks
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile

# (name, query heads, KV heads, head dim)
SHAPES = [("smollm2-135m", 9, 3, 64), ("llama-3-8b", 32, 8, 128)]
PAGES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
         "fp8_e5m2": torch.float8_e5m2}
BLOCK = 16


def decode_case(name: str, heads: int, kv_heads: int, head_dim: int, context: int, batch: int, repeats: int,
                copy_bw: float) -> dict:
    generator = torch.Generator().manual_seed(0)
    pages = -(-context // BLOCK)
    num_blocks = batch * pages * 2  # twice what the batch uses: its pages lie apart, as a busy pool's do
    base = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=generator)
    pools = {kind: (base.to(dtype), (base * 0.5).to(dtype)) for kind, dtype in PAGES.items()}
    table = torch.randperm(num_blocks, generator=generator)[:batch * pages].view(batch, pages).int()
    q = torch.randn(batch, heads, head_dim, generator=generator)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    # The C++ kernel itself for every page type (the public entry ties unquantized pages to q's dtype).
    rows, out, ours = cu[:-1].long(), torch.empty_like(q), pd_kernels.cpu.build().paged_decode_attention
    calls = {kind: (lambda k=k, v=v: ours(q, k, v, table, lens, rows, head_dim**-0.5, 0, 0.0, 1.0, 1.0, out))
             for kind, (k, v) in pools.items()}
    q16 = q.bfloat16()
    k16, v16 = pools["bf16"]
    calls["bf16_queries"] = lambda: pd_kernels.unified_attention(q16, k16, v16, cu, lens, table, head_dim**-0.5,
                                                                  backend="cpu")
    times = {kind: [] for kind in calls}
    for _ in range(repeats + 1):  # alternating, so a slow moment of the host falls on every kind alike
        for kind, call in calls.items():
            start = time.perf_counter()
            call()
            times[kind].append(time.perf_counter() - start)
    median = {kind: percentile(t[1:], 50) for kind, t in times.items()}
    kv_bytes = {kind: 2 * batch * context * kv_heads * head_dim * dtype.itemsize for kind, dtype in PAGES.items()}
    return {
        "case": "decode_attention", "shape": name, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "context": context, "batch": batch,
        "median_ms": {kind: round(s * 1e3, 3) for kind, s in median.items()},
        "speedup_over_bf16_pages": {kind: round(median["bf16"] / median[kind], 3) for kind in calls},
        "kv_gb_per_s": {kind: round(kv_bytes[kind] / median[kind] / 1e9, 2) for kind in PAGES},
        "copy_gb_per_s": round(copy_bw / 1e9, 2),
    }


def transfer_case(model: str) -> dict:
    from pd import SamplingParams
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine
    from transfer import KVHandle, create_transport

    prompt = list(range(5, 5 + 20 * BLOCK))
    moved = {}
    for kind, options in (("bf16", {"dtype": "bfloat16"}), ("fp8_e4m3", {"dtype": "bfloat16",
                                                                         "kv_cache_dtype": "fp8_e4m3"})):
        config = EngineConfig(model=model, num_blocks=64, block_size=BLOCK, **options)
        prefill = LLMEngine(config, create_transport("nixl", f"bench-prefill-{kind}"))
        decode = LLMEngine(config, create_transport("nixl", f"bench-decode-{kind}"))
        try:
            prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0), pin_kv=True)
            handle = None
            while handle is None:
                handle = next((o.kv_handle for o in prefill.step() if o.finished), None)
            decode.add_request("p", prompt, SamplingParams(max_tokens=2, temperature=0),
                               remote_kv=KVHandle.decode(handle))
            while decode.has_unfinished_requests():
                decode.step()
                prefill.step()
            stats = decode.stats()
            if stats.num_remote_pulls != 1:
                raise RuntimeError(f"the {kind} pair did not pull: {stats}")
            moved[kind] = {"blocks": stats.num_pulled_blocks, "bytes": stats.num_pulled_bytes}
        finally:
            for engine in (prefill, decode):
                engine.connector.transport.close()
                engine.close()
    return {"case": "transfer", "model": model, "prompt_tokens": len(prompt), "moved": moved,
            "fp8_over_bf16_bytes": round(moved["fp8_e4m3"]["bytes"] / moved["bf16"]["bytes"], 4),
            "measured_by": "NIXL telemetry (totalBytes of each read)"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--skip-transfer", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    host = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads": args.threads}
    copy_bw = measure_peaks()[1]
    for name, heads, kv_heads, head_dim in SHAPES:
        print(json.dumps({**decode_case(name, heads, kv_heads, head_dim, args.context, args.batch, args.repeats,
                                        copy_bw), **host}), flush=True)
    if not args.skip_transfer:
        print(json.dumps({**transfer_case(args.model), **host}), flush=True)


if __name__ == "__main__":
    main()
