"""Disaggregated against colocated serving, on the built-in model, at low load.

``python -m bench.serve [--requests 24] [--concurrency 2]`` starts
``serve_configs/default.yaml`` and then ``serve_configs/colocated.yaml`` on a
local Ray, sends the same streamed completions to each (a mix of short
prompts, prefilled locally, and long ones, prefilled remotely), and prints one
JSON line per mode with TTFT and inter-token latency p50/p90, then one line
with the disaggregated/colocated ratios of those medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import yaml

CONFIGS = {"disaggregated": "default.yaml", "colocated": "colocated.yaml"}
CONFIG_DIR = Path(__file__).resolve().parents[1] / "serve_configs"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_one(port: int, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streamed completion over raw HTTP."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "builtin:tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    start = time.perf_counter()
    stamps = []
    async for line in reader:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            stamps.append(time.perf_counter())
    writer.close()
    if not stamps:
        raise RuntimeError("empty stream")
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


async def load(port: int, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list[float], list[float]]:
    queue = list(prompts)
    ttfts, gaps = [], []

    async def worker() -> None:
        while queue:
            ttft, itl = await stream_one(port, queue.pop(), max_tokens)
            ttfts.append(ttft)
            gaps.extend(itl)

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return ttfts, gaps


def run_mode(mode: str, prompts: list[str], args) -> dict:
    from ray import serve

    from pd.serve.app import build_app

    config = yaml.safe_load((CONFIG_DIR / CONFIGS[mode]).read_text())
    port = config["http_options"]["port"]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config["applications"][0]["args"]), name="pd", route_prefix="/")
    asyncio.run(load(port, prompts[:4], args.max_tokens, args.concurrency))  # warm-up
    ttfts, gaps = asyncio.run(load(port, prompts[4:], args.max_tokens, args.concurrency))
    serve.delete("pd")
    return {
        "mode": mode, "requests": len(ttfts),
        "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1), "ttft_p90_ms": round(1e3 * percentile(ttfts, 0.9), 1),
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 2), "itl_p90_ms": round(1e3 * percentile(gaps, 0.9), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    import ray

    rng = random.Random(0)
    words = "the sea block table cache token prefill decode river mountain".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.choice([20, 40, 300, 500])))
               for _ in range(args.requests + 4)]
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        results = {mode: run_mode(mode, prompts, args) for mode in CONFIGS}
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    for result in results.values():
        print(json.dumps(result), flush=True)
    d, c = results["disaggregated"], results["colocated"]
    print(json.dumps({"case": "ratio_disaggregated_over_colocated",
                      "ttft_p50": round(d["ttft_p50_ms"] / c["ttft_p50_ms"], 3),
                      "itl_p50": round(d["itl_p50_ms"] / c["itl_p50_ms"], 3)}), flush=True)


if __name__ == "__main__":
    main()
