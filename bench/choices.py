"""``n`` choices against ``n`` separate requests: prompt tokens computed and latency.

``python -m bench.choices [--n 4] [--trials 5] [--max-tokens 16]`` starts
``serve_configs/default.yaml`` on a private local Ray (``pd.serve.local``). For each trial it takes a fresh
prompt (a unique first block, so nothing is cached), sends one completion
with ``n`` choices, then the same prompt with another unique first block as
``n`` concurrent requests of one choice, and reads from the pools' stats how
many prompt tokens each way computed (admitted, less prefix-cache hits and
pulled blocks). Prints one JSON line per prompt path (short prompts prefill
on the decode replica, long ones on the prefill pool) with the medians, the
ratios n-choices / separate, and n-choices against ``n`` times the prompt
(what the choices would cost computing it each; goal: about 1/n). On one
replica per pool, separate requests that arrive a step apart share the
prompt through the prefix cache too; n choices share it by construction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import requests

from bench.configs import BENCH_MODEL, bench_app_args, load_config
from pd.serve.local import deploy_args, local_serve, pool_stats
from pd.workload.host import cpu_name

PROMPTS = {"local": "Tell me about the sea and the sky.", "remote": " ".join(f"word{i}" for i in range(150))}


def computed_prompt_tokens() -> int:
    total = 0
    for pool in ("DecodeServer", "PrefillServer"):
        for stats in pool_stats(pool):
            total += stats["num_prompt_tokens"] - stats["num_prefix_hit_tokens"]
            total -= stats["num_pulled_blocks"] * 16 if pool == "DecodeServer" else 0
    return total


def timed(fn) -> tuple[float, int]:
    before = computed_prompt_tokens()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, computed_prompt_tokens() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    config = load_config("default.yaml")
    port = config["http_options"]["port"]
    with local_serve(http_port=port) as local:
        deploy_args(local, bench_app_args(config))
        compare(f"http://127.0.0.1:{port}/v1/completions", args)


def compare(url: str, args: argparse.Namespace) -> None:
    """Each prompt path's trials, n choices against n separate requests; one JSON line per path."""
    prompt_lens = []

    def complete(prompt: str, n: int, seed: int) -> None:
        body = {"model": BENCH_MODEL, "prompt": prompt, "n": n, "max_tokens": args.max_tokens,
                "temperature": 1.0, "seed": seed, "ignore_eos": True}
        response = requests.post(url, json=body, timeout=300)
        response.raise_for_status()
        prompt_lens.append(response.json()["usage"]["prompt_tokens"])

    complete("warm-up", args.n, 0)
    pool = ThreadPoolExecutor(args.n)
    try:
        for path, text in PROMPTS.items():
            together, separate = [], []
            prompt_lens.clear()
            for trial in range(args.trials):
                prompt = f"{uuid.uuid4().hex} {text}"
                together.append(timed(lambda: complete(prompt, args.n, trial)))
                prompt = f"{uuid.uuid4().hex} {text}"
                separate.append(timed(lambda: list(pool.map(lambda i: complete(prompt, 1, 1000 * trial + i),
                                                            range(args.n)))))
            med = {name: (statistics.median(t for t, _ in runs), statistics.median(c for _, c in runs))
                   for name, runs in (("n_choices", together), ("separate", separate))}
            print(json.dumps({
                "bench": "choices", "path": path, "n": args.n, "cpu": cpu_name(), "trials": args.trials,
                "n_choices_latency_s": round(med["n_choices"][0], 3), "separate_latency_s": round(med["separate"][0], 3),
                "n_choices_prompt_tokens": med["n_choices"][1], "separate_prompt_tokens": med["separate"][1],
                "unshared_prompt_tokens": args.n * statistics.median(prompt_lens),
                "prompt_tokens_ratio": round(med["n_choices"][1] / med["separate"][1], 3),
                "prompt_tokens_vs_unshared": round(med["n_choices"][1] / (args.n * statistics.median(prompt_lens)), 3),
                "latency_ratio": round(med["n_choices"][0] / med["separate"][0], 3),
            }), flush=True)
    finally:
        pool.shutdown()


if __name__ == "__main__":
    main()
