"""The replicas a prefill decision scores: the longest prefix's holders plus a random few, never the pool."""

from __future__ import annotations

import random
from collections import Counter

from router.candidates import sample_candidates
from router.hashing import hash_block_tokens
from router.policy import ReplicaLoad
from router.prefix_index import PrefixIndex

BLOCK = 4


def _pool(num_replicas: int, **fields) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", **fields) for i in range(num_replicas)]


def _ids(candidates: list[ReplicaLoad]) -> list[str]:
    return [replica.replica_id for replica in candidates]


def test_a_small_pool_is_scored_whole():
    pool = _pool(4)
    assert _ids(sample_candidates(PrefixIndex(100), [], pool, 4, 2, random.Random(0))) == _ids(pool)


def test_the_longest_prefix_holders_come_first_then_a_sample():
    prompt = hash_block_tokens(list(range(32 * BLOCK)), BLOCK)
    index = PrefixIndex(10_000)
    for i in range(0, 64, 8):
        index.insert(f"r{i}", prompt[:4])  # the tenant's context: a shorter prefix, on 8 replicas
    index.insert("r13", prompt[:20])
    index.insert("r14", prompt)  # the deepest
    pool = _pool(64)
    candidates = _ids(sample_candidates(index, prompt, pool, 3, 2, random.Random(0)))
    assert candidates[0] == "r14"  # the longest prefix; then one of the first block's holders (room for 2)
    assert candidates[1] in {f"r{i}" for i in range(0, 64, 8)} | {"r13"}
    assert 3 + 1 <= len(candidates) <= 2 + 3 and len(set(candidates)) == len(candidates)


def test_a_prefix_every_replica_holds_costs_no_more_candidates():
    """A system prompt on all 256 replicas: a few of its holders, not all of them."""
    prompt = hash_block_tokens(list(range(8 * BLOCK)), BLOCK)
    index = PrefixIndex(100_000)
    pool = _pool(256)
    for replica in pool:
        index.insert(replica.replica_id, prompt)
    rng = random.Random(1)
    for _ in range(50):
        candidates = sample_candidates(index, prompt, pool, 4, 4, rng)
        assert 4 <= len(candidates) <= 8 and len(set(_ids(candidates))) == len(candidates)


def test_holders_outside_the_pool_are_left_out():
    """Serve hands the router the replicas it may use now: a holder that left (or is excluded) is not scored."""
    prompt = hash_block_tokens(list(range(8 * BLOCK)), BLOCK)
    index = PrefixIndex(1000)
    index.insert("gone", prompt)
    candidates = sample_candidates(index, prompt, _pool(32), 4, 4, random.Random(0))
    assert "gone" not in _ids(candidates) and len(candidates) == 4


def test_the_adapters_holders_are_candidates():
    pool = _pool(40)
    pool[17] = ReplicaLoad("r17", adapters=("x",), max_loras=2)
    for seed in range(20):
        assert "r17" in _ids(sample_candidates(PrefixIndex(10), [], pool, 2, 2, random.Random(seed), adapter="x"))


def test_the_sample_reaches_every_replica():
    """Power-of-k: over many decisions every replica is drawn, about equally often."""
    pool = _pool(32)
    rng = random.Random(2)
    drawn = Counter(replica_id for _ in range(4000)
                    for replica_id in _ids(sample_candidates(PrefixIndex(10), [], pool, 2, 2, rng)))
    assert set(drawn) == set(_ids(pool))
    assert max(drawn.values()) < 1.3 * min(drawn.values())
