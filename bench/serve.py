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
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Iterable, Iterator

import requests
import yaml

from bench.stats import percentile

CONFIGS = {"disaggregated": "default.yaml", "colocated": "colocated.yaml"}
CONFIG_DIR = Path(__file__).resolve().parents[1] / "serve_configs"


def sse_events(lines: Iterable[bytes]) -> Iterator[dict]:
    """The JSON events of a server-sent event stream's lines, up to ``data: [DONE]``.

    Lines other than ``data:`` ones (blank separators, comments) are skipped;
    an event carrying ``error`` raises ``RuntimeError``.
    """
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line.removeprefix(b"data:").strip()
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(event["error"])
        yield event


def stream_one(session: requests.Session, url: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streamed completion, each event stamped as its line arrives."""
    body = {"model": "builtin:tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    # stream=True hands over each chunk as it arrives; iter_lines undoes the chunked framing.
    with session.post(url, json=body, stream=True) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
        stamps = [time.perf_counter() for _ in sse_events(response.iter_lines())]
    if not stamps:
        raise RuntimeError("empty stream")
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def load(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list[float], list[float]]:
    """Stream every prompt, ``concurrency`` at a time; (every TTFT, every inter-token gap)."""
    pending: SimpleQueue[str] = SimpleQueue()
    for prompt in prompts:
        pending.put(prompt)
    ttfts, gaps = [], []

    def worker() -> None:
        with requests.Session() as session:  # one per thread: a Session is not thread-safe
            while True:
                try:
                    prompt = pending.get_nowait()
                except Empty:
                    return
                ttft, itl = stream_one(session, url, prompt, max_tokens)
                ttfts.append(ttft)
                gaps.extend(itl)

    with ThreadPoolExecutor(concurrency) as pool:
        for done in [pool.submit(worker) for _ in range(concurrency)]:
            done.result()  # re-raises a worker's failure
    return ttfts, gaps


def run_mode(mode: str, prompts: list[str], args) -> dict:
    from ray import serve

    from pd.serve.app import build_app

    config = yaml.safe_load((CONFIG_DIR / CONFIGS[mode]).read_text())
    port = config["http_options"]["port"]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config["applications"][0]["args"]), name="pd", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1/completions"
    load(url, prompts[:4], args.max_tokens, args.concurrency)  # warm-up
    ttfts, gaps = load(url, prompts[4:], args.max_tokens, args.concurrency)
    serve.delete("pd")
    return {
        "mode": mode, "requests": len(ttfts),
        "ttft_p50_ms": round(1e3 * percentile(ttfts, 50), 1), "ttft_p90_ms": round(1e3 * percentile(ttfts, 90), 1),
        "itl_p50_ms": round(1e3 * percentile(gaps, 50), 2), "itl_p90_ms": round(1e3 * percentile(gaps, 90), 2),
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
