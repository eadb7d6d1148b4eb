"""The host tier: evicted prefix blocks demoted to host memory, found again and promoted with the same tokens."""

from __future__ import annotations

import random

import pytest
import torch

from pd import LLM, SamplingParams
from pd.engine.block_pool import BlockPool, Evictions
from pd.engine.kv_layout import kv_block_bytes
from pd.engine.tiers.host import HostTier

BLOCK = 4  # tokens per block in the pure-Python tests


def test_the_pool_reports_each_eviction_before_reusing_the_block():
    evictions, evicted = Evictions(), []
    pool = BlockPool(3, evictions=evictions)
    evictions.bind(lambda block_id, block_hash, tokens: evicted.append((block_id, block_hash, tokens)))
    blocks = pool.allocate(3)
    for block_id in blocks:
        pool.insert(block_id, bytes([block_id]), (block_id,) * BLOCK)
    pool.free([2, 0, 1])  # LRU: 2, then 0, then 1
    pool.allocate(2)
    assert evicted == [(2, b"\x02", (2,) * BLOCK), (0, b"\x00", (0,) * BLOCK)]


def device_cache(num_blocks: int) -> torch.Tensor:
    return torch.arange(num_blocks * 6, dtype=torch.float32).reshape(num_blocks, 2, 3)


def test_a_demoted_block_comes_back_with_its_contents():
    device = device_cache(4)
    tier = HostTier(device, num_blocks=2)
    original = device[1].clone()
    tier.demote(1, b"h1", (7,) * BLOCK)
    tier.flush()  # what the engine does after scheduling, before the block is written again
    device[1].zero_()  # the device reuses the block
    assert tier.match([b"h1"], (7,) * BLOCK, BLOCK, start=0) == [b"h1"]
    tier.reserve([b"h1"])
    assert tier.promote([b"h1"], [3]) == [(7,) * BLOCK]
    assert torch.equal(device[3], original)
    assert (tier.stats.num_demoted_blocks, tier.stats.num_promoted_blocks) == (1, 1)


def test_match_verifies_tokens_and_stops_at_the_first_miss():
    tier = HostTier(device_cache(4), num_blocks=4)
    tier.demote(0, b"a", (1,) * BLOCK)
    tier.demote(1, b"b", (2,) * BLOCK)
    tokens = (1,) * BLOCK + (2,) * BLOCK
    assert tier.match([b"a", b"b"], tokens, BLOCK, start=0) == [b"a", b"b"]
    assert tier.match([b"a", b"b"], (1,) * BLOCK + (3,) * BLOCK, BLOCK, start=0) == [b"a"]  # same hash, other tokens
    assert tier.match([b"x", b"b"], tokens, BLOCK, start=0) == []
    assert tier.match([b"b"], tokens, BLOCK, start=1) == [b"b"]  # block 1 of the prompt


def test_a_full_tier_drops_its_least_recently_used_but_never_a_block_being_promoted():
    tier = HostTier(device_cache(4), num_blocks=2)
    tier.demote(0, b"a", (0,) * BLOCK)
    tier.demote(1, b"b", (1,) * BLOCK)
    tier.demote(0, b"a", (0,) * BLOCK)  # again: no copy, just recently used
    tier.demote(2, b"c", (2,) * BLOCK)  # evicts b
    assert tier.match([b"b"], (1,) * BLOCK, BLOCK, 0) == [] and tier.match([b"a"], (0,) * BLOCK, BLOCK, 0) == [b"a"]
    tier.reserve([b"a", b"c"])
    tier.demote(3, b"d", (3,) * BLOCK)  # nowhere to go: both slots are being read
    assert tier.match([b"d"], (3,) * BLOCK, BLOCK, 0) == []
    assert tier.stats.num_demoted_blocks == 3 and tier.stats.num_host_cached_blocks == 2


def test_demotions_are_copied_together_later_and_whatever_touches_their_blocks_first_flushes(monkeypatch):
    import pd_kernels.cpu as cpu_kernels

    copies = []
    copy_blocks = cpu_kernels.copy_blocks
    monkeypatch.setattr(cpu_kernels, "copy_blocks", lambda src, src_ids, dst, dst_ids: (
        copies.append((list(src_ids), list(dst_ids))), copy_blocks(src, src_ids, dst, dst_ids)))
    device = device_cache(8)
    originals = device.clone()
    tier = HostTier(device, num_blocks=4)
    for block_id in (0, 1, 2):
        tier.demote(block_id, bytes([block_id]), (block_id,) * BLOCK)
    assert tier.num_pending_demotions == 3 and copies == []  # nothing copied on the allocation path
    tier.flush()
    assert copies == [([0, 1, 2], [0, 1, 2])] and tier.num_pending_demotions == 0  # one batch
    assert tier.num_pinned_slots == 0
    device[:3] = -1
    tier.reserve([b"\x01"])
    tier.promote([b"\x01"], [7])
    assert torch.equal(device[7], originals[1])
    # A promotion issues the pending copies first: it may read a block just demoted, or write over one.
    tier.demote(3, b"\x03", (3,) * BLOCK)
    tier.reserve([b"\x03"])
    tier.promote([b"\x03"], [6])
    assert torch.equal(device[6], originals[3])
    # A load's slots are handed out with no copy outstanding: its reader thread writes into them.
    tier.demote(4, b"\x04", (4,) * BLOCK)
    tier.take_slots(1)
    assert tier.num_pending_demotions == 0
    device[4] = -1
    tier.reserve([b"\x04"])
    tier.promote([b"\x04"], [5])
    assert torch.equal(device[5], originals[4])


def test_every_step_issues_its_demotions_before_the_model_writes_to_the_blocks(engines):
    _, tiered = engines
    engine = tiered.engine
    pending_at_forward = []
    execute = engine.runner.execute

    def checked(out, block_tables):
        pending_at_forward.append(engine.tiers.host.num_pending_demotions)
        return execute(out, block_tables)

    engine.runner.execute = checked
    try:
        demoted = engine.stats().num_demoted_blocks
        rng = random.Random(1)
        for _ in range(5):
            tiered.generate([[rng.randrange(100, 1000) for _ in range(120)]], SamplingParams(max_tokens=2))
    finally:
        engine.runner.execute = execute
    assert engine.stats().num_demoted_blocks > demoted
    assert pending_at_forward and set(pending_at_forward) == {0}


@pytest.fixture(scope="module")
def engines():
    """The same small engine with and without a host tier: 24 device blocks of 16 tokens, 96 on the host."""
    plain = LLM("builtin:tiny-llama", num_blocks=24)
    block_bytes = kv_block_bytes(plain.engine.model_config, 16, plain.engine.runner.dtype)
    tiered = LLM("builtin:tiny-llama", num_blocks=24, host_kv_cache_bytes=96 * block_bytes)
    return plain, tiered


def test_a_prefix_evicted_from_the_device_hits_in_the_host_tier_with_the_same_tokens(engines):
    plain, tiered = engines
    rng = random.Random(0)
    first = [rng.randrange(100, 1000) for _ in range(130)]  # 8 full blocks
    churn = [[rng.randrange(100, 1000) for _ in range(120)] for _ in range(6)]  # 7-8 blocks each: evicts it
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = {}
    for name, llm in (("plain", plain), ("tiered", tiered)):
        [out] = llm.generate([first], params)
        for prompt in churn:
            llm.generate([prompt], params)
        before = llm.engine.stats()
        [again] = llm.generate([first], params)
        after = llm.engine.stats()
        outputs[name] = (out.token_ids, again.token_ids, after.num_prefix_hit_tokens - before.num_prefix_hit_tokens)
    assert outputs["plain"][0] == outputs["plain"][1] == outputs["tiered"][0] == outputs["tiered"][1]
    assert outputs["plain"][2] == 0  # gone from the device pool: recomputed
    assert outputs["tiered"][2] == 8 * 16  # every full block from the host tier
    stats = tiered.engine.stats()
    assert stats.num_promoted_blocks >= 8 and stats.num_demoted_blocks >= 8
    assert stats.num_used_blocks == 0


def test_host_tier_size_is_checked():
    with pytest.raises(ValueError, match="host_kv_cache_bytes must be >= 0"):
        LLM("builtin:tiny-llama", num_blocks=8, host_kv_cache_bytes=-1)
    with pytest.raises(ValueError, match="holds no block"):
        LLM("builtin:tiny-llama", num_blocks=8, host_kv_cache_bytes=100)
