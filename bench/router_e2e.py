"""The prefix-affinity router on a real Serve app: hit rates measured by the engines.

``python -m bench.router_e2e [--replicas 4] [--requests 160]`` starts the
default app with ``--replicas`` prefill replicas of the built-in model, once
with ``PrefixAffinityRouter`` and once with the power-of-two ``PinnedRequestRouter``,
replays the same generated multi-tenant trace against the prefill pool (each
trace block id becomes ``--tokens-per-block`` deterministic tokens), and
prints one JSON line per router: the prefix hit rate the engines report
(hit tokens over prompt tokens) and the requests each replica served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter
from pathlib import Path

import yaml

from router.hashing import hash_block_tokens
from router.trace import MultiTenantTraceConfig, generate_multi_tenant

ROUTERS = {"pd": "router.serve:PrefixAffinityRouter", "pow2": "router.serve:PinnedRequestRouter"}
CONFIG = Path(__file__).resolve().parents[1] / "serve_configs" / "default.yaml"


def block_tokens(block_id: int, tokens_per_block: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(block_id)
    return [rng.randrange(1, vocab) for _ in range(tokens_per_block)]


def prompts(num_requests: int, tokens_per_block: int, seed: int) -> list[list[int]]:
    trace = generate_multi_tenant(MultiTenantTraceConfig(num_requests=num_requests, num_tenants=16, seed=seed))
    return [[t for b in r.hash_ids for t in block_tokens(b, tokens_per_block)] for r in trace]


async def replay(handle, token_lists: list[list[int]], concurrency: int) -> Counter:
    from pd import SamplingParams
    from pd.serve.messages import PoolControl, PoolRequest, PrefillResult

    placed: Counter = Counter()
    queue = list(enumerate(token_lists))
    params = SamplingParams(max_tokens=1, temperature=0)

    async def worker() -> None:
        while queue:
            index, token_ids = queue.pop(0)
            request = PoolRequest(request_id=f"trace-{index}", token_ids=token_ids, sampling=params,
                                  block_hashes=hash_block_tokens(token_ids, 16))
            result = PrefillResult.decode(await handle.prefill.remote(request.encode()))
            await handle.release.remote(PoolControl(request_id=request.request_id,
                                                    target_replica_id=result.replica_id).encode())
            placed[result.replica_id] += 1

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return placed


def run(router: str, token_lists: list[list[int]], args) -> dict:
    from ray import serve

    from pd.serve.app import build_app

    app_args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    app_args["engine"]["kv_cache_bytes"] = args.kv_cache_mib * 1024**2
    app_args["prefill"].update(num_replicas=args.replicas, ray_actor_options={"num_cpus": 0.25},
                               router={"request_router_class": ROUTERS[router],
                                       "request_router_kwargs": json.loads(args.pd_kwargs) if router == "pd" else {}})
    serve.run(build_app(app_args), name="pd", route_prefix="/")
    handle = serve.get_deployment_handle("PrefillServer", "pd")
    placed = asyncio.run(replay(handle, token_lists, args.concurrency))
    from pd.serve.messages import PoolControl

    stats = [handle.stats_of.remote(PoolControl(request_id="", target_replica_id=r).encode()).result()
             for r in placed]
    serve.delete("pd")
    hits = sum(s["num_prefix_hit_tokens"] for s in stats)
    total = sum(s["num_prompt_tokens"] for s in stats)
    counts = [placed[r] for r in placed] + [0] * (args.replicas - len(placed))
    return {
        "router": router, "replicas": args.replicas, "requests": len(token_lists),
        "engine_hit_rate": round(hits / total, 4) if total else None,
        "routed_per_replica": sorted(counts, reverse=True),
        "max_min_load_ratio": round(max(counts) / min(counts), 3) if min(counts) else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--tokens-per-block", type=int, default=32, help="tokens per trace block id")
    parser.add_argument("--kv-cache-mib", type=int, default=16, help="KV pool per replica")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pd-kwargs", default="{}", help="JSON PolicyConfig overrides for the pd router")
    args = parser.parse_args()
    import ray
    from ray import serve

    token_lists = prompts(args.requests, args.tokens_per_block, args.seed)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        for router in ROUTERS:
            print(json.dumps(run(router, token_lists, args)), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
