"""Pools that grow and shrink in simulated time, and the autoscalers that size them."""

from __future__ import annotations

import pytest

from autoscale.planner import Bounds, PlannerConfig, Slo
from pd.sampling_params import SamplingParams
from pd.workload.trace import BurstyTraceConfig, generate_bursty
from sim.autoscale import PlannerAutoscaler, RayDefaultAutoscaler, StaticAutoscaler, capacity, run
from sim.clock import EventLoop
from sim.cluster import SimCluster
from sim.plan import attainment
from sim.workload import submit_trace
from tests.sim.test_cluster import COST, prompts, spec

SLO = Slo(ttft_s=0.5, itl_s=0.05)


def test_a_retired_replica_drains_its_requests_and_leases_before_it_stops():
    loop = EventLoop()
    cluster = SimCluster(loop, spec(num_prefill=2, num_decode=2))
    for index, prompt in enumerate(prompts(16, lengths=(400, 600))):
        loop.at(index * 0.01, lambda index=index, prompt=prompt: cluster.submit(
            f"r{index}", prompt, SamplingParams(max_tokens=20, ignore_eos=True)))
    retired = {}  # replica id -> (pool, its busy seconds when retired)

    def retire_the_busiest_of_each_pool() -> None:
        for pool in cluster.pools():
            busy = max(pool.replica_ids, key=pool.in_flight)
            assert pool.in_flight(busy) > 0  # mid-flight: what it holds must finish
            pool.retire(busy)
            assert busy not in pool.replica_ids and busy in pool.live_ids()  # no new requests, not stopped
            retired[busy] = (pool, pool.replicas[busy].busy_s)

    loop.at(0.08, retire_the_busiest_of_each_pool)
    loop.run()
    stopped = next(replica_id for replica_id, (pool, _) in retired.items() if pool is cluster.decode)
    with pytest.raises(ValueError, match="not serving"):
        cluster.decode.retire(stopped)
    assert all(len(r.token_times_s) == 20 and r.finished_s is not None for r in cluster.records.values())
    assert sum(s.num_recompute_fallbacks for s in (r.engine.stats() for r in cluster.decode.replicas.values())) == 0
    for replica_id, (pool, busy_s) in retired.items():
        replica = pool.replicas[replica_id]
        assert replica.busy_s > busy_s  # it kept computing what it held after it was retired
        assert pool.stopped_at(replica_id) is not None and replica_id not in pool.live_ids()
        assert replica.engine.stats().num_pinned_leases == 0 and replica.engine.stats().num_used_blocks == 0


def test_a_new_replica_serves_only_after_its_startup():
    loop = EventLoop()
    cluster = SimCluster(loop, spec(num_prefill=0, num_decode=1))
    new = cluster.decode.add(startup_s=5.0)
    assert cluster.decode.num_target == 2 and new not in cluster.decode.replica_ids
    loop.at(5.0, lambda: None)
    loop.run()
    assert new in cluster.decode.replica_ids
    assert [load.replica_id for load in cluster.decode.loads()] == cluster.decode.replica_ids
    assert cluster.decode.replica_seconds() == 10.0  # both from t=0: a starting replica costs its time


def short_burst():
    return generate_bursty(BurstyTraceConfig(duration_s=90.0, base_rate_per_s=3.0, step_start=0.3, step_end=0.6,
                                             user_tokens=(200, 600), output_tokens=(16, 48)))


def serve(autoscaler, num_prefill=1, num_decode=1):
    cluster = SimCluster(EventLoop(), spec(num_prefill=num_prefill, num_decode=num_decode))
    trace = short_burst()
    submit_trace(cluster, trace)
    until_s = trace[-1].timestamp_ms / 1000
    timeline = run(cluster, autoscaler, until_s, startup_s=2.0)
    return cluster, timeline, sum(pool.replica_seconds(until_s) for pool in cluster.pools())


def planner_config(**changes) -> PlannerConfig:
    cap = capacity(COST, max_num_batched_tokens=512, context_tokens=600)
    return PlannerConfig(slo=SLO, capacity=cap, prefill=Bounds(1, 6), decode=Bounds(1, 6), period_s=2.0,
                         scale_down_delay_s=10.0, **changes)


@pytest.mark.slow  # minutes of a simulated autoscaled pool: 3 s
def test_the_planner_follows_the_step_and_spends_less_than_the_static_peak():
    planner = PlannerAutoscaler(planner_config())
    cluster, timeline, replica_seconds = serve(planner)
    peak = max(timeline.num_prefill), max(timeline.num_decode)
    assert peak[0] > 1  # it scaled prefill up on the step ...
    assert timeline.num_prefill[-1] < peak[0]  # ... and back down after it
    static_cluster, _, static_seconds = serve(StaticAutoscaler(*peak, period_s=2.0), *peak)
    assert replica_seconds < 0.8 * static_seconds
    assert attainment(cluster, SLO) >= 0.8 * attainment(static_cluster, SLO)
    assert all(r.finished_s is not None for r in cluster.records.values())  # scaling down lost nothing


@pytest.mark.slow  # a whole simulated trace through a fleet: 3 s on 2 cores
def test_rays_default_policy_runs_on_the_simulated_clock():
    # Ray's own policy: 2 ongoing requests per replica, 30 s up-delay by default; here shortened.
    ray = RayDefaultAutoscaler((1, 6), (1, 6), period_s=1.0, upscale_delay_s=3.0, downscale_delay_s=10.0)
    cluster, timeline, _ = serve(ray)
    assert max(timeline.num_decode) > 1  # every stream in flight counts: decode grows
    assert all(r.finished_s is not None for r in cluster.records.values())


@pytest.mark.slow  # a whole simulated trace through a fleet: 3 s on 2 cores
def test_a_static_fleet_never_moves():
    _, timeline, _ = serve(StaticAutoscaler(2, 3, period_s=2.0), 2, 3)
    assert set(timeline.num_prefill) == {2} and set(timeline.num_decode) == {3}
