"""The replicas a prefill or decode decision scores: the longest prefix's holders plus a random few, never the
pool."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.candidates import sample_candidates
from router.decode_policy import DecodePolicy, DecodePolicyConfig
from router.hashing import hash_block_tokens
from router.policy import ReplicaLoad
from router.prefix_index import PrefixIndex

BLOCK = 4


def _pool(num_replicas: int, **fields) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", **fields) for i in range(num_replicas)]


def _prompt(num_tokens: int, first_token: int = 0) -> tuple[list[bytes], int]:
    return hash_block_tokens(list(range(first_token, first_token + num_tokens)), BLOCK), num_tokens


def _decode_policy(**overrides) -> DecodePolicy:
    return DecodePolicy(DecodePolicyConfig(block_size=BLOCK, **overrides))


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


def test_decode_scores_the_prefix_holders_and_a_sample_not_the_whole_pool():
    block_hashes, num_tokens = _prompt(64)
    index = PrefixIndex(max_blocks=1 << 16)
    for holder in ("r7", "r42"):
        index.insert(holder, block_hashes)
    pool = [ReplicaLoad(f"r{i}", num_active_requests=i % 5) for i in range(300)]
    policy = _decode_policy(num_sampled=16, max_prefix_candidates=8, seed=1)
    drawn = [policy.candidates(index, block_hashes, pool) for _ in range(50)]
    assert all({"r7", "r42"} <= {load.replica_id for load in loads} and len(loads) <= 18 for loads in drawn)
    assert len({load.replica_id for loads in drawn for load in loads}) > 200  # the sample moves
    # A pool of num_sampled or fewer is scored whole, in its order, drawing nothing (decisions as before).
    small = pool[:16]
    state = policy._rng.getstate()
    assert policy.candidates(index, block_hashes, small) == small and policy._rng.getstate() == state
    with pytest.raises(ValueError, match="num_sampled must be >= 1"):
        _decode_policy(num_sampled=0)
    with pytest.raises(ValueError, match="max_prefix_candidates must be >= 0"):
        _decode_policy(max_prefix_candidates=-1)


def test_decode_placement_over_candidates_keeps_to_the_least_active():
    """Power-of-k over a pool of 300 decode replicas with one idle in each ten: most choices land on an idle one
    (16 samples miss all 30 with probability 0.9 ** 16, about 0.19)."""
    index, policy = PrefixIndex(max_blocks=1 << 16), _decode_policy(seed=2)
    pool = [ReplicaLoad(f"r{i}", num_active_requests=0 if i % 10 == 0 else 8) for i in range(300)]
    chosen = []
    for number in range(100):
        block_hashes, num_tokens = _prompt(32, first_token=1000 * number)
        loads = policy.candidates(index, block_hashes, pool)
        chosen.append(policy.choose(loads, index.match_tiers(block_hashes, [r.replica_id for r in loads]),
                                    num_tokens).replica_id)
    idle_share = sum(int(replica_id[1:]) % 10 == 0 for replica_id in chosen) / len(chosen)
    assert idle_share >= 0.7, idle_share
