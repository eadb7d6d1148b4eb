"""Which replicas one prefill decision scores: the longest prefix's holders and a few sampled, power-of-k.

    candidates = up to max_prefix_candidates replicas holding the prompt's longest cached prefix
                 (then, if room is left, some holding its first block: a shorter prefix of it)
               + up to max_prefix_candidates replicas holding the request's LoRA adapter (only for one)
               + num_sampled replicas drawn at random from the pool

Scoring a replica (``router.latency``) is the decision's cost, so a
decision that scores a few costs the same at 16 replicas and at 1,000. The
holders are where a hit can only be; the sample is where an empty queue
can be. Drawing a few at random and taking the best of them is the
power-of-k choice, which keeps a pool's queues within a small factor of
scoring them all, and keeps several routers (ingress replicas) that read
the same stale report from all picking its one least loaded replica.

A pool of at most ``num_sampled`` replicas is scored whole. Finding the
holders is a binary search over the prompt's blocks
(``PrefixIndex.deepest_holders``), not a step per replica; the only step
per replica left is mapping ids to their loads, in C.
"""

from __future__ import annotations

import random
from operator import attrgetter
from typing import Sequence

from router.policy import ReplicaLoad
from router.prefix_index import PrefixIndex

_replica_id = attrgetter("replica_id")


def sample_candidates(index: PrefixIndex, block_hashes: Sequence[bytes], replicas: Sequence[ReplicaLoad],
                      num_sampled: int, max_prefix_candidates: int, rng: random.Random,
                      adapter: str | None = None) -> list[ReplicaLoad]:
    """The replicas to score (module docstring), each once, prefix holders first; all of them in a small pool."""
    if len(replicas) <= num_sampled:
        return list(replicas)
    by_id = dict(zip(map(_replica_id, replicas), replicas))
    chosen: dict[str, ReplicaLoad] = {}
    _, deepest = index.deepest_holders(block_hashes)
    _add_some(chosen, by_id, deepest, max_prefix_candidates, rng)
    if deepest and len(chosen) < max_prefix_candidates:
        _, shallow = index.deepest_holders(block_hashes[:1])
        _add_some(chosen, by_id, shallow, max_prefix_candidates - len(chosen), rng)
    if adapter is not None:
        holding = [replica.replica_id for replica in replicas if adapter in replica.adapters]
        _add_some(chosen, by_id, holding, max_prefix_candidates, rng)
    for position in rng.sample(range(len(replicas)), num_sampled):
        chosen.setdefault(replicas[position].replica_id, replicas[position])
    return list(chosen.values())


def _add_some(chosen: dict[str, ReplicaLoad], by_id: dict[str, ReplicaLoad], replica_ids: list[str],
              limit: int, rng: random.Random) -> None:
    """Up to ``limit`` of ``replica_ids`` that are in the pool and not chosen yet, at random where more are."""
    if len(replica_ids) > 4 * limit:
        picked = _draw(replica_ids, by_id, chosen, limit, rng)
    else:
        picked = [replica_id for replica_id in replica_ids if replica_id in by_id and replica_id not in chosen]
        if len(picked) > limit:
            picked = rng.sample(picked, limit)
    for replica_id in picked:
        chosen[replica_id] = by_id[replica_id]


def _draw(replica_ids: list[str], by_id: dict[str, ReplicaLoad], chosen: dict[str, ReplicaLoad], limit: int,
          rng: random.Random) -> list[str]:
    """``limit`` of many ``replica_ids`` (a system prompt every replica holds) without a step for each:
    draws until enough are in the pool and new, or a bounded number of draws is spent."""
    picked: list[str] = []
    for _ in range(8 * limit):
        replica_id = replica_ids[rng.randrange(len(replica_ids))]
        if replica_id in by_id and replica_id not in chosen and replica_id not in picked:
            picked.append(replica_id)
            if len(picked) == limit:
                break
    return picked
