"""The prefix-affinity router on a real Serve app: hit rates measured by the engines.

``python -m bench.router_e2e [--replicas 4] [--requests 160] [--seeds 0,1,2]``
starts the default app with ``--replicas`` prefill replicas of the built-in
model, once with ``PrefixAffinityRouter`` and once with the power-of-two
``PinnedRequestRouter``, replays the same generated multi-tenant trace against
the prefill pool (each trace block id becomes ``--tokens-per-block``
deterministic tokens), and prints one JSON line per router and seed: the
prefix hit rate the engines report (hit tokens over prompt tokens) and the
requests each replica served. A last line gives the median over seeds of the
pd/pow2 hit-rate ratio.

Each run is its own process with its own Ray instance: a process that has
called a deployment keeps that deployment's request router, even after the
app is deleted and deployed again with another router class.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter

from bench.configs import bench_app_args, load_config
from pd.serve.local import LocalServe, deploy_args, local_serve
from pd.workload.stats import percentile
from pd.workload.trace import MultiTenantTraceConfig, generate_multi_tenant
from router.hashing import hash_block_tokens

ROUTERS = {"pd": "router.serve:PrefixAffinityRouter", "pow2": "router.serve:PinnedRequestRouter"}


def block_tokens(block_id: int, tokens_per_block: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(block_id)
    return [rng.randrange(1, vocab) for _ in range(tokens_per_block)]


def prompts(num_requests: int, tokens_per_block: int, seed: int) -> list[list[int]]:
    trace = generate_multi_tenant(MultiTenantTraceConfig(num_requests=num_requests, num_tenants=16, seed=seed))
    return [[t for b in r.hash_ids for t in block_tokens(b, tokens_per_block)] for r in trace]


async def replay(handle, token_lists: list[list[int]], concurrency: int) -> Counter:
    from pd import SamplingParams
    from pd.serve.protocol import PoolControl, PoolRequest, PrefillResult
    from router.protocol import RouteHints

    placed: Counter = Counter()
    queue = list(enumerate(token_lists))
    params = SamplingParams(max_tokens=1, temperature=0)

    async def worker() -> None:
        while queue:
            index, token_ids = queue.pop(0)
            request_id = f"trace-{index}"
            request = PoolRequest(request_id=request_id, token_ids=tuple(token_ids), sampling=params)
            hints = RouteHints(request_id=request_id, num_prompt_tokens=len(token_ids),
                               block_hashes=tuple(hash_block_tokens(token_ids, 16)))
            result = PrefillResult.decode(await handle.prefill.remote(hints.encode(), request.encode()))
            release = RouteHints(request_id=request_id, target_replica_id=result.replica_id)
            await handle.release.remote(release.encode(), PoolControl(request_id=request_id).encode())
            placed[result.replica_id] += 1

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return placed


def run(router: str, local: LocalServe, token_lists: list[list[int]], args) -> dict:
    from ray import serve

    app_args = bench_app_args(load_config("default.yaml"))
    app_args["engine"]["kv_cache_bytes"] = args.kv_cache_mib * 1024**2
    app_args["prefill"].update(num_replicas=args.replicas, ray_actor_options={"num_cpus": 0.25},
                               router={"request_router_class": ROUTERS[router],
                                       "request_router_kwargs": json.loads(args.pd_kwargs) if router == "pd" else {}})
    deploy_args(local, app_args)
    handle = serve.get_deployment_handle("PrefillServer", "pd")
    placed = asyncio.run(replay(handle, token_lists, args.concurrency))
    from router.protocol import RouteHints

    stats = [handle.stats_of.remote(RouteHints(request_id="", target_replica_id=r).encode()).result()
             for r in placed]
    local.delete("pd")
    hits = sum(s["num_prefix_hit_tokens"] for s in stats)
    total = sum(s["num_prompt_tokens"] for s in stats)
    counts = [placed[r] for r in placed] + [0] * (args.replicas - len(placed))
    return {
        "router": router, "replicas": args.replicas, "requests": len(token_lists),
        "engine_hit_rate": round(hits / total, 4) if total else None,
        "routed_per_replica": sorted(counts, reverse=True),
        "max_min_load_ratio": round(max(counts) / min(counts), 3) if min(counts) else None,
    }


def run_in_subprocess(router: str, seed: int, args) -> dict:
    import subprocess
    import sys

    command = [sys.executable, "-m", "bench.router_e2e", "--router", router, "--seeds", str(seed),
               "--replicas", str(args.replicas), "--requests", str(args.requests),
               "--tokens-per-block", str(args.tokens_per_block), "--kv-cache-mib", str(args.kv_cache_mib),
               "--concurrency", str(args.concurrency), "--pd-kwargs", args.pd_kwargs]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{router} run (seed {seed}) failed with {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--tokens-per-block", type=int, default=32, help="tokens per trace block id")
    parser.add_argument("--kv-cache-mib", type=int, default=16, help="KV pool per replica")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seeds", default="0", help="comma-separated trace seeds")
    parser.add_argument("--pd-kwargs", default="{}", help="JSON PolicyConfig overrides for the pd router")
    parser.add_argument("--router", choices=tuple(ROUTERS), help="run only this router, in this process")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if args.router is None:
        ratios = []
        for seed in seeds:
            results = {router: run_in_subprocess(router, seed, args) for router in ROUTERS}
            for result in results.values():
                print(json.dumps(result), flush=True)
            ratios.append(results["pd"]["engine_hit_rate"] / results["pow2"]["engine_hit_rate"])
        print(json.dumps({"summary": "pd_over_pow2_hit_rate", "kv_cache_mib": args.kv_cache_mib, "seeds": seeds,
                          "ratios": [round(r, 3) for r in ratios], "median": round(percentile(ratios, 50), 3)}))
        return

    [seed] = seeds
    token_lists = prompts(args.requests, args.tokens_per_block, seed)
    with local_serve() as local:
        result = run(args.router, local, token_lists, args)
    print(json.dumps({"seed": seed, "kv_cache_mib": args.kv_cache_mib, **result}), flush=True)


if __name__ == "__main__":
    main()
