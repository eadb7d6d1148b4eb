"""What one prefill routing decision costs, in wall time, by pool size and prompt length.

``python -m bench.router_cost [--replicas 16,256] [--decisions 2000] [--policies affinity,latency]``

A decision here is what ``bench.router`` times: the policy's ``choose``
and its bookkeeping (``record_routed``: the index's optimistic insert, the
recent counts, the predictor's queue). It runs on a warm pool, without the
simulator around it, so that its p99 is the decision's own and not a
collection the simulator set off: the index holds ``4 x replicas`` tenants'
contexts of ``--context-tokens`` (each on one replica), and the prompts
are turns of those tenants (the context plus fresh text: the longest
prompts a router sees, all of whose blocks it must match) and, in
``--short-share`` of them, 100-token prompts nobody holds. Every replica
reports every ``replicas`` decisions, as a pool does every second at one
request per replica per second.

Prints one JSON line per (replicas, policy): ``decide_us_p50``,
``decide_us_p99``, ``decide_us_max``, and the machine (``bench.router_matrix.machine_info``).
The garbage collector is paused while a decision runs, as in ``bench.router``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from bench.router import resolve_policy
from pd.workload.stats import percentile
from router.hashing import hash_block_tokens
from router.latency import LatencyPolicyConfig, PredictedLatencyPolicy
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad
from router.protocol import RoutingStats

BLOCK_SIZE = 64
# An H200-like step law (base, per token, per pair, per seq, per sample), so the latency policy decides at once.
PRIOR = (4e-3, 6e-5, 3e-11, 2e-5, 1e-4)


def make_policy(name: str, seed: int):
    """``pd`` (the app's default prefill router), ``latency`` or ``affinity`` (``bench.router``)."""
    resolved = resolve_policy(name)
    if resolved == "affinity":
        return PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK_SIZE, seed=seed))
    if resolved == "latency":
        return PredictedLatencyPolicy(LatencyPolicyConfig(block_size=BLOCK_SIZE, seed=seed, prior=PRIOR))
    raise ValueError(f"unknown policy {name!r}; expected pd, latency or affinity")


def prompts(num_tenants: int, context_tokens: int, num_prompts: int, short_share: float,
            rng: random.Random) -> tuple[list[list[bytes]], list[tuple[int, list[bytes], int]]]:
    """Each tenant's context hashes, and the prompts: ``(tenant or -1, hashes, tokens)``."""
    contexts = [hash_block_tokens([tenant] * context_tokens, BLOCK_SIZE) for tenant in range(num_tenants)]
    out = []
    for number in range(num_prompts):
        if rng.random() < short_share:
            tokens = [10_000_000 + number] * 100
            out.append((-1, hash_block_tokens(tokens, BLOCK_SIZE), 100))
            continue
        tenant = rng.randrange(num_tenants)
        tail = hash_block_tokens([20_000_000 + number] * 256, BLOCK_SIZE, parent_hash=contexts[tenant][-1])
        out.append((tenant, contexts[tenant] + tail, context_tokens + 256))
    return contexts, out


def run(policy_name: str, num_replicas: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    policy = make_policy(policy_name, args.seed)
    replica_ids = [f"r{i}" for i in range(num_replicas)]
    contexts, requests = prompts(4 * num_replicas, args.context_tokens, args.decisions, args.short_share, rng)
    for tenant, hashes in enumerate(contexts):
        policy.index.insert(replica_ids[tenant % num_replicas], hashes)
    loads = [ReplicaLoad(replica_id, num_active_requests=rng.randrange(8)) for replica_id in replica_ids]
    observe = getattr(policy, "observe", None)
    decide_ns = []
    for number, (_, hashes, num_tokens) in enumerate(requests):
        if number % num_replicas == 0:
            for replica_id in replica_ids:
                stats = RoutingStats(num_waiting_tokens=rng.randrange(16_384), num_free_blocks=4096)
                observe(replica_id, stats, number / num_replicas) if observe else policy.reported(replica_id)
        now_s = number / num_replicas
        gc.disable()
        started_ns = time.perf_counter_ns()
        if observe is not None:
            decision = policy.choose(hashes, num_tokens, loads, now_s)
            policy.record_routed(decision, hashes, now_s)
        else:
            decision = policy.choose(hashes, num_tokens, loads)
            policy.record_routed(decision, hashes)
        decide_ns.append(time.perf_counter_ns() - started_ns)
        gc.enable()
    return {"policy": policy_name, "replicas": num_replicas, "context_tokens": args.context_tokens,
            "decisions": len(decide_ns), "decide_us_p50": round(percentile(decide_ns, 50) / 1000, 1),
            "decide_us_p99": round(percentile(decide_ns, 99) / 1000, 1),
            "decide_us_max": round(max(decide_ns) / 1000, 1)}


def main(argv: list[str] | None = None) -> None:
    from bench.router_matrix import machine_info

    parser = argparse.ArgumentParser(prog="python -m bench.router_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="16,256", help="comma-separated pool sizes")
    parser.add_argument("--policies", default="affinity,latency")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--context-tokens", type=int, default=30_000)
    parser.add_argument("--short-share", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps({"machine": machine_info()}), flush=True)
    for num_replicas in (int(value) for value in args.replicas.split(",")):
        for policy_name in args.policies.split(","):
            print(json.dumps(run(policy_name.strip(), num_replicas, args)), flush=True)


if __name__ == "__main__":
    main()
