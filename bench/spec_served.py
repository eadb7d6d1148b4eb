"""Speculative decoding served P/D: the default app with and without it, under the load tester's client.

``python -m bench.spec_served [--concurrency 1,8] [--max-tokens 96] [--method ngram] [--num-prompts 8]``

Starts a private Ray with Serve and deploys ``serve_configs/default.yaml``'s
app serving the trained SmolLM2-135M-Instruct in fp32, once without and once
with ``engine: {speculative_config: {method, num_speculative_tokens}}``.
Each time the grounded workload's chat prompts (``bench.spec_workloads``:
edit or extract from a 450-600-token source, so each is prefilled on the
prefill pool, its KV pulled, and the decode pool speculates) are streamed
through ``loadtest.client`` at each concurrency, greedy. Prints one JSON line
per (mode, concurrency): TPOT p50 (per request: a verify step's tokens arrive
in one chunk), output tokens/s, failures, the decode pool's acceptance; then
one line per concurrency with the ratios (plain over spec for TPOT, spec over
plain for tokens/s) and how many answers were the same text. Absolute times
on a shared host move; the two modes run one after the other, so compare
the ratios of repeated runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from bench.configs import bench_app_args, load_config
from bench.spec_workloads import grounded
from loadtest import client
from pd.serve.local import deploy_args, local_serve, pool_stats
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.workloads import LoadRequest

MODEL = "builtin:smollm2-135m-instruct"
PORT = 8123


def run_load(url: str, prompts: list[list[dict]], concurrency: int, max_tokens: int) -> tuple[list, float]:
    """Every prompt streamed once, ``concurrency`` at a time: the results in prompt order, and the wall time."""
    options = client.RequestOptions(model=MODEL, ignore_eos=False, temperature=0.0)
    loads = [LoadRequest(index=i, kind="grounded", max_tokens=max_tokens,
                         messages=tuple((m["role"], m["content"]) for m in messages))
             for i, messages in enumerate(prompts)]

    def one(request: LoadRequest):
        with requests.Session() as session:
            return client.send(session, url, client.CHAT_PATH, client.request_body(request, True, options), options)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, loads))
    return results, time.perf_counter() - started


def spec_counts() -> tuple[int, int]:
    """The decode pool's draft tokens verified and accepted so far."""
    stats = pool_stats("DecodeServer")
    return (sum(s.get("spec_num_draft_tokens", 0) for s in stats),
            sum(s.get("spec_num_accepted_tokens", 0) for s in stats))


def summary(results: list, wall_s: float) -> dict:
    done = [r for r in results if r.error is None]
    tpots = [r.tpot_s for r in done if r.output_tokens > 1]
    return {"requests": len(results), "failed": len(results) - len(done),
            "errors": sorted({r.error for r in results if r.error})[:3],
            "tpot_p50_s": statistics.median(tpots) if tpots else None,
            "output_tok_s": sum(r.output_tokens for r in done) / wall_s,
            "output_tokens": sum(r.output_tokens for r in done)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    prompts = grounded()[:args.num_prompts]
    levels = [int(c) for c in args.concurrency.split(",")]
    base = bench_app_args(load_config("default.yaml"), MODEL)
    base["engine"] = {**base["engine"], "dtype": "float32"}
    host = {"cpu": cpu_name(), "isa": [f for f in ("avx512f", "avx2", "amx_tile") if f in cpu_flags()]}
    measured = {}
    with local_serve(http_port=PORT) as local:
        url = f"http://127.0.0.1:{PORT}"
        for mode in ("plain", "spec"):
            engine = dict(base["engine"])
            if mode == "spec":
                engine["speculative_config"] = {"method": args.method, "num_speculative_tokens": args.k}
            deploy_args(local, {**base, "engine": engine})
            run_load(url, prompts[:1], 1, 8)  # the first request's one-time costs, paid outside the figures
            for concurrency in levels:
                before = spec_counts()
                results, wall = run_load(url, prompts, concurrency, args.max_tokens)
                row = summary(results, wall)
                drafted, accepted = (after - was for after, was in zip(spec_counts(), before))
                row["acceptance_rate"] = accepted / drafted if drafted else None
                measured[mode, concurrency] = (row, [r.text for r in results])
                print(json.dumps({"mode": mode, "concurrency": concurrency, "method": args.method, **row, **host}),
                      flush=True)
    for concurrency in levels:
        (plain, plain_texts), (spec, spec_texts) = measured["plain", concurrency], measured["spec", concurrency]
        print(json.dumps({
            "concurrency": concurrency, "method": args.method,
            "tpot_ratio": plain["tpot_p50_s"] / spec["tpot_p50_s"] if spec["tpot_p50_s"] else None,
            "tok_s_ratio": spec["output_tok_s"] / plain["output_tok_s"],
            "same_texts": sum(a == b for a, b in zip(plain_texts, spec_texts)), "requests": len(prompts),
            "failed": plain["failed"] + spec["failed"], **host}), flush=True)


if __name__ == "__main__":
    main()
