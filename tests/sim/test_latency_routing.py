"""The predicted-latency router in simulated time: it learns a slow replica's speed from its reports and
sends it less, where the token-cost router, blind to speed, keeps feeding it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pd.config import EngineConfig
from pd.sampling_params import SamplingParams
from pd.workload.stats import percentile
from router.latency import LatencyPolicyConfig, PredictedLatencyPolicy
from router.policy import PolicyConfig
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.cost import CostModel
from sim.placement import AffinityPlacement, LatencyPlacement

COST = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-8, per_seq_s=2e-4, per_sample_s=1e-4)
CONFIG = EngineConfig(model="builtin:tiny-llama", block_size=16, num_blocks=4096, max_num_batched_tokens=512,
                      max_num_seqs=64)
SLOW = "decode-3"


def _serve(placement_for) -> SimCluster:
    loop = EventLoop()
    spec = ClusterSpec(decode=PoolSpec(4, CONFIG, COST), call_s=0.001, report_period_s=0.5)
    cluster = SimCluster(loop, spec, placement_for(loop))
    slow = cluster.decode.replicas[SLOW].engine.runner
    slow.cost = dataclasses.replace(COST, **{name: 4 * getattr(COST, name) for name in
                                             ("base_s", "per_token_s", "per_pair_s", "per_seq_s", "per_sample_s")})
    rng = random.Random(0)
    for index in range(600):  # distinct prompts: no prefix to follow, only speed and load to weigh
        prompt = [rng.randrange(1, 1000) for _ in range(rng.choice((100, 300, 600)))]
        loop.at(index * 0.02, lambda index=index, prompt=prompt: cluster.submit(
            f"r{index}", prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    loop.run()
    return cluster


def test_a_slow_replica_is_learned_and_sent_less():
    latency = _serve(lambda loop: LatencyPlacement(LatencyPolicyConfig(block_size=16, max_num_batched_tokens=512),
                                                   loop.time))
    tokens = _serve(lambda _: AffinityPlacement(PolicyConfig(block_size=16)))
    speeds = {replica_id: latency.decode.placement.policies[0].predictor.fit.speed(replica_id)
              for replica_id in latency.decode.replica_ids}
    assert speeds[SLOW] > 3 * max(speed for replica_id, speed in speeds.items() if replica_id != SLOW)
    share = {name: cluster.decode.num_routed[SLOW] / 600 for name, cluster in (("latency", latency),
                                                                               ("tokens", tokens))}
    assert share["latency"] < 0.6 * share["tokens"]
    p99 = {name: percentile([r.ttft_s for r in cluster.records.values()], 99)
           for name, cluster in (("latency", latency), ("tokens", tokens))}
    assert p99["latency"] < p99["tokens"]


def test_the_simulator_runs_the_apps_default_prefill_router_or_the_one_named():
    """The simulator places prefills with the app's default router (``pd.config.app``: the predicted-latency
    one), the real policy unmodified, or with the prefix-affinity router where the spec names it; it refuses
    any other, naming the two it runs."""
    from pd.config.app import AFFINITY_ROUTER, PREFILL_ROUTER

    spec = ClusterSpec(decode=PoolSpec(1, CONFIG, COST), prefill=PoolSpec(2, CONFIG, COST))
    assert spec.prefill_router == PREFILL_ROUTER
    placement = SimCluster(EventLoop(), spec).prefill.placement
    assert isinstance(placement, LatencyPlacement)
    assert type(placement.policies[0]) is PredictedLatencyPolicy
    affinity = dataclasses.replace(spec, prefill_router=AFFINITY_ROUTER)
    assert type(SimCluster(EventLoop(), affinity).prefill.placement) is AffinityPlacement
    with pytest.raises(ValueError, match="PrefixAffinityRouter"):
        dataclasses.replace(spec, prefill_router="router.serve:PinnedRequestRouter")
