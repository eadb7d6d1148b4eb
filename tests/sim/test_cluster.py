"""The simulated deployment: the ingress's rule, both pools' routers and real KV leases and pulls."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pd.config import EngineConfig
from pd.sampling_params import SamplingParams
from router.policy import PolicyConfig
from router.remote_prefill import RemotePrefillRule
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.cost import CostModel
from sim.placement import AffinityPlacement
from sim.replica import summarize
from sim.transport import TransferModel

COST = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-7, per_seq_s=2e-4, per_sample_s=1e-4)
CONFIG = EngineConfig(model="builtin:tiny-llama", block_size=16, num_blocks=2048, max_num_batched_tokens=512,
                      max_num_seqs=64)
LINK = TransferModel(per_transfer_s=1e-3, per_descriptor_s=1e-5, bytes_per_s=2e9)


def spec(num_prefill=1, num_decode=2, **changes) -> ClusterSpec:
    prefill = PoolSpec(num_prefill, CONFIG, COST) if num_prefill else None
    return ClusterSpec(decode=PoolSpec(num_decode, CONFIG, COST), prefill=prefill,
                       **{"transfer": LINK, "call_s": 0.001, **changes})


def serve(cluster_spec: ClusterSpec, prompts: list[list[int]], max_tokens=12, every_s=0.02) -> SimCluster:
    loop = EventLoop()
    cluster = SimCluster(loop, cluster_spec)
    for index, prompt in enumerate(prompts):
        loop.at(index * every_s, lambda index=index, prompt=prompt: cluster.submit(
            f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    loop.run()
    return cluster


def prompts(num: int, lengths=(64, 600), shared: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(1, 1000) for _ in range(shared)]
    return [head + [rng.randrange(1, 1000) for _ in range(rng.choice(lengths))] for _ in range(num)]


def pool_stats(cluster: SimCluster, pool: str):
    return [replica.engine.stats() for replica in getattr(cluster, pool).replicas.values()]


def test_long_prompts_prefill_remotely_and_every_lease_ends_pulled():
    cluster = serve(spec(), prompts(30))
    assert all(len(r.token_times_s) == 12 and r.finished_s is not None for r in cluster.records.values())
    prefill, decode = pool_stats(cluster, "prefill"), pool_stats(cluster, "decode")
    remote = sum(1 for p in prompts(30) if len(p) > 256)
    assert sum(s.num_remote_pulls for s in decode) == cluster.network.num_reads == remote
    assert sum(s.num_recompute_fallbacks for s in decode) == 0
    assert all(s.num_pinned_leases == 0 and s.num_used_blocks == 0 for s in prefill)  # every lease released


def test_the_ingress_rule_decides_a_threshold_above_every_prompt_keeps_them_local():
    cluster = serve(spec(rule=RemotePrefillRule(threshold=10_000)), prompts(30))
    assert cluster.network.num_reads == 0
    assert all(s.num_prompt_tokens == 0 for s in pool_stats(cluster, "prefill"))


def test_a_decode_replica_pulls_only_the_blocks_it_lacks():
    """Every prompt shares 20 blocks; once the decode pool reports holding them, pulls shrink."""
    shared = prompts(40, lengths=(40,), shared=320)
    cluster = serve(spec(num_decode=1, rule=RemotePrefillRule(threshold=16)), shared, every_s=0.1)
    decode = pool_stats(cluster, "decode")[0]
    assert decode.num_prefix_hit_tokens > 0
    full = sum(-(-len(p) // 16) for p in shared)
    assert 0 < decode.num_pulled_blocks < full / 2


def test_a_slower_link_delays_the_second_token_not_the_first():
    fast = serve(spec(), prompts(10, lengths=(600,)), every_s=0.5)
    slow = serve(spec(transfer=dataclasses.replace(LINK, bytes_per_s=2e7)), prompts(10, lengths=(600,)), every_s=0.5)
    first = [r.token_times_s[0] - r.arrival_s for r in fast.records.values()]
    assert first == [r.token_times_s[0] - r.arrival_s for r in slow.records.values()]
    gap = lambda c: [r.token_times_s[1] - r.token_times_s[0] for r in c.records.values()]  # noqa: E731
    assert min(b - a for a, b in zip(gap(fast), gap(slow))) > 0.1  # 600 tokens of KV at 20 MB/s


def test_the_prefill_router_spreads_load_and_follows_prefixes():
    cluster = serve(spec(num_prefill=3), prompts(60, lengths=(400,), shared=256), every_s=0.01)
    prompt_tokens = [s.num_prompt_tokens for s in pool_stats(cluster, "prefill")]
    assert min(prompt_tokens) > 0  # no replica starved
    assert sum(s.num_prefix_hit_tokens for s in pool_stats(cluster, "prefill")) > 0


def test_colocated_has_no_prefill_pool_and_the_same_seed_repeats_exactly():
    first = serve(spec(num_prefill=0), prompts(30))
    second = serve(spec(num_prefill=0), prompts(30))
    assert first.prefill is None and first.network is None
    assert summarize(list(first.records.values())) == summarize(list(second.records.values()))
    runs = [serve(spec(), prompts(30)) for _ in range(2)]
    assert [r.token_times_s for r in runs[0].records.values()] == [r.token_times_s for r in runs[1].records.values()]


def test_pools_must_share_a_block_size():
    with pytest.raises(ValueError, match="block_size"):
        ClusterSpec(decode=PoolSpec(1, CONFIG, COST), prefill=PoolSpec(1, dataclasses.replace(CONFIG, block_size=32), COST))


def test_a_shared_store_lets_a_replica_hit_on_a_prefix_another_computed_and_the_router_sees_it():
    """Colocated, two replicas, one simulated shared store: the real tiers write through and query it, the real
    router's index counts what it holds as on every replica, and the same seed repeats."""
    from router.hashing import hash_block_tokens
    from router.tiers import Tier

    block_bytes = 4 * 2 * CONFIG.block_size * 64 * 4  # more than a block of the built-in model
    config = dataclasses.replace(CONFIG, host_kv_cache_bytes=64 * block_bytes, shared_kv_bucket="unused-by-the-sim",
                                 shared_kv_bytes=1 << 30)
    batch = prompts(21, lengths=(100,), shared=320, seed=3)

    def run() -> SimCluster:
        loop = EventLoop()
        cluster = SimCluster(loop, ClusterSpec(decode=PoolSpec(2, config, COST), call_s=0.001))
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        cluster.submit("first", batch[0], params)
        loop.run()  # served on one replica; its blocks written through to the store
        for index, prompt in enumerate(batch[1:]):  # a burst: the router spreads it over both
            loop.at(loop.now + index * 0.001, lambda index=index, prompt=prompt: cluster.submit(f"r{index}", prompt,
                                                                                                 params))
        loop.run()
        return cluster

    cluster = run()
    stats = pool_stats(cluster, "decode")
    assert all(s.num_prompt_tokens > 0 for s in stats)  # both replicas served
    assert sum(s.shared_read_blocks for s in stats) >= 320 // CONFIG.block_size  # the other one read the head
    assert len(cluster.shared_store) > 0
    head = hash_block_tokens(batch[0][:320], CONFIG.block_size)
    runs = cluster.decode.index.match_tiers(head, cluster.decode.replica_ids)
    assert set(runs) == set(cluster.decode.replica_ids)
    assert all(len(run) == len(head) and set(run) <= {Tier.DEVICE, Tier.HOST, Tier.SHARED} for run in runs.values())
    again = run()
    assert summarize(list(cluster.records.values())) == summarize(list(again.records.values()))


def test_the_predicted_rule_falls_back_to_the_threshold_then_decides_by_seconds():
    """Before any report the threshold decides (every prompt here is long: remote); once the pools and the
    transfers have reported, predictions do: over a slow link a pull costs more than a local prefill, and
    prompts stay local, while over a fast one they keep going remote (the decodes a local prefill would
    stall weigh against it)."""
    rule, every = RemotePrefillRule(predicted=True), prompts(80, lengths=(300, 600))
    slow = serve(spec(rule=rule, transfer=dataclasses.replace(LINK, bytes_per_s=2e6)), every, every_s=0.05)
    fast = serve(spec(rule=rule), every, every_s=0.05)
    for cluster in (slow, fast):
        assert all(r.finished_s is not None and len(r.token_times_s) == 12 for r in cluster.records.values())
        views = cluster.rule_views
        assert views["decode"].predictor.transfer.seconds(1) is not None and views["prefill"].predictor.ready()
    assert 20 <= slow.network.num_reads < 60  # the first second's, by the threshold, then while the pulls queued
    assert fast.network.num_reads == 80
    with pytest.raises(ValueError, match="predicted-latency prefill router"):
        SimCluster(EventLoop(), spec(rule=rule), AffinityPlacement(PolicyConfig(block_size=16)))
