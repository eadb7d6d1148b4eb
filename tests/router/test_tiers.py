"""What a hit in each tier is worth, and how placement weighs it (pure, no Serve)."""

from __future__ import annotations

import pytest

from router.decode_policy import DecodePolicy, DecodePolicyConfig
from router.hashing import hash_block_tokens
from router.policy import PolicyConfig, PrefixAffinityPolicy, ReplicaLoad, RoutingReason
from router.prefix_index import SHARED_STORE, PrefixIndex
from router.tiers import BLOCK_BYTES, DEFAULT_HIT_VALUES, RECOMPUTE_S, Tier, hit_value, valued_tokens

BLOCK = 16
HOST, DISK, SHARED = Tier.HOST, Tier.DISK, Tier.SHARED


def prompt(num_tokens: int) -> tuple[list[bytes], int]:
    return hash_block_tokens(list(range(num_tokens)), BLOCK), num_tokens


def idle(*replica_ids: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id) for replica_id in replica_ids]


def test_default_hit_values_follow_from_the_stated_figures():
    assert BLOCK_BYTES == 2 << 20
    assert DEFAULT_HIT_VALUES == {Tier.DEVICE: 1.0, HOST: 0.94, DISK: 0.72, SHARED: 0.44}
    assert hit_value(BLOCK_BYTES / 1e9, RECOMPUTE_S) == 0.0  # a store read at 1 GB/s is worth nothing
    assert PolicyConfig(block_size=BLOCK).hit_values() == (1.0, 0.94, 0.72, 0.44)
    assert DecodePolicyConfig(block_size=BLOCK, disk_hit_value=0.5).hit_values() == (1.0, 0.94, 0.5, 0.44)


@pytest.mark.parametrize("config", [PolicyConfig, DecodePolicyConfig])
@pytest.mark.parametrize("overrides", [dict(host_hit_value=1.5), dict(disk_hit_value=-0.1), dict(shared_hit_value=2)])
def test_hit_values_are_fractions(config, overrides):
    with pytest.raises(ValueError, match=next(iter(overrides))):
        config(block_size=BLOCK, **overrides)


def test_valued_tokens_weigh_each_matched_token_by_its_tier():
    values = (1.0, 0.5, 0.25, 0.125)
    assert valued_tokens((Tier.DEVICE, HOST, SHARED), values, BLOCK, 100) == (48, 16 + 8 + 2)
    # The last prompt token is always computed: it comes off the last block's value.
    assert valued_tokens((Tier.DEVICE, HOST, SHARED), values, BLOCK, 48) == (47, 16 + 8 + 15 / 8)
    assert valued_tokens((HOST,) * 4, values, BLOCK, 20) == (19, 9.5)
    # A device-only run, as a count or as tiers, is worth exactly its matched tokens.
    assert valued_tokens(3, values, BLOCK, 48) == (47, 47.0)
    assert valued_tokens((Tier.DEVICE,) * 3, values, BLOCK, 48) == (47, 47.0)
    assert valued_tokens((), values, BLOCK, 10) == (0, 0.0)


def test_a_faster_tier_wins_a_hit_of_the_same_length():
    block_hashes, num_tokens = prompt(100)
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK))
    policy.index.insert("device", block_hashes[:4])
    policy.index.insert("host", block_hashes[:4], HOST)
    policy.index.insert("disk", block_hashes[:4], DISK)
    policy.index.insert(SHARED_STORE, block_hashes[:4], SHARED)  # "other" reads it from the shared store
    decision = policy.choose(block_hashes, num_tokens, idle("other", "disk", "host", "device"))
    assert decision.ranked_replica_ids == ("device", "host", "disk", "other")
    assert (decision.reason, decision.matched_tokens, decision.uncached_tokens) == (RoutingReason.PREFIX, 64, 36)
    decision = policy.choose(block_hashes, num_tokens, idle("other", "disk", "host"))
    assert (decision.replica_id, decision.reason, decision.matched_tokens) == ("host", RoutingReason.PREFIX, 64)


def test_a_longer_host_hit_beats_a_shorter_device_hit_when_the_values_say_so():
    block_hashes, num_tokens = prompt(100)
    for host_hit_value, winner in ((0.94, "b"), (0.3, "a")):  # b's 80 tokens are worth 75.2, or 24, against a's 32
        policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, host_hit_value=host_hit_value))
        policy.index.insert("a", block_hashes[:2])
        policy.index.insert("b", block_hashes[:5], HOST)
        decision = policy.choose(block_hashes, num_tokens, idle("a", "b", "c"))
        assert (decision.replica_id, decision.reason) == (winner, RoutingReason.PREFIX), host_hit_value
        assert decision.matched_tokens == {"a": 32, "b": 80}[winner]  # the raw run, whatever its tiers
        assert decision.uncached_tokens == num_tokens - decision.matched_tokens


def test_decode_values_the_blocks_a_replica_holds_by_tier():
    block_hashes, num_tokens = prompt(64)
    index = PrefixIndex(100)
    index.insert("a", block_hashes, DISK)  # the whole prompt: 63 tokens worth 45.36
    index.insert("b", block_hashes[:3])  # 48 tokens worth 48
    decode = DecodePolicy(DecodePolicyConfig(block_size=BLOCK))
    runs = index.match_tiers(block_hashes, ["a", "b", "c"])
    decision = decode.choose(idle("a", "b", "c"), runs, num_tokens)
    assert decision.ranked_replica_ids == ("b", "a", "c")
    assert (decision.reason, decision.matched_tokens) == (RoutingReason.PREFIX, 48)
    # As counts (device blocks, what PrefixIndex.match gives), a's longer run wins.
    assert decode.choose(idle("a", "b", "c"), index.match(block_hashes), num_tokens).replica_id == "a"
