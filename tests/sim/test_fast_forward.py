"""Fast-forwarded decode runs (sim.fast_forward) give exactly what stepping one step at a time gives."""

from __future__ import annotations

import random

from pd.config import EngineConfig
from pd.sampling_params import SamplingParams
from pd.workload.trace import TraceRequest
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.cost import CostModel
from sim.engine import sim_engine
from sim.replica import replay
from sim.transport import TransferModel

COST = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-7, per_seq_s=2e-4, per_sample_s=1e-4)
# Blocks of 16 tokens: a decode crosses a block boundary every 16 steps, many times in each request.
CONFIG = EngineConfig(model="builtin:tiny-llama", block_size=16, num_blocks=2048, max_num_batched_tokens=512,
                      max_num_seqs=64)
LINK = TransferModel(per_transfer_s=1e-3, per_descriptor_s=1e-5, bytes_per_s=2e9)


def staggered(num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """Requests arriving every few ms while earlier ones decode (outputs of 16 to 500 tokens)."""
    rng = random.Random(seed)
    return [TraceRequest(timestamp_ms=i * rng.uniform(1.0, 40.0), input_length=rng.choice((512, 1024, 2048)),
                         output_length=rng.choice((256, 1600, 4000, 8000)), hash_ids=(rng.randrange(3), 100 + i))
            for i in range(num_requests)]


def engine_figures(engine) -> dict:
    return {"step_sums": (engine.step_sums.gram, engine.step_sums.moments), "step_times": vars(engine.step_times),
            "num_steps": engine.runner.num_steps, "stats": engine.stats(), "events": engine.cache_events()}


def test_a_replica_fast_forwarded_serves_exactly_as_one_stepped_one_step_at_a_time():
    trace = staggered(40)
    runs = {}
    for fast in (False, True):
        engine = sim_engine(CONFIG, COST, seed=3)
        records = replay(trace, engine, block_tokens=32, fast_forward=fast)
        runs[fast] = ([(r.arrival_s, r.token_times_s, r.num_cached_tokens, r.finished_s) for r in records],
                      engine_figures(engine), engine.runner.num_fast_forwarded_steps)
    assert runs[True][0] == runs[False][0]  # every token's time, so TTFT, ITL and finish times
    assert runs[True][1] == runs[False][1]  # the steps' sums, step count, prefix-cache events, counters
    assert runs[False][2] == 0 and runs[True][2] > 0.8 * runs[True][1]["num_steps"]


def serve(fast: bool, num_prefill: int) -> SimCluster:
    rng = random.Random(1)
    prefill = PoolSpec(num_prefill, CONFIG, COST) if num_prefill else None
    cluster = SimCluster(EventLoop(), ClusterSpec(decode=PoolSpec(2, CONFIG, COST), prefill=prefill, transfer=LINK,
                                                  call_s=0.001, report_period_s=0.05))
    for pool in cluster.pools():
        for replica in pool.replicas.values():
            replica.fast_forward = fast
    shared = [rng.randrange(1, 1000) for _ in range(200)]
    for index in range(40):
        prompt = shared[:rng.choice((0, 100, 200))] + [rng.randrange(1, 1000) for _ in range(rng.choice((30, 600)))]
        params = SamplingParams(max_tokens=rng.choice((1, 5, 40, 150)), ignore_eos=True)
        cluster.loop.at(index * rng.uniform(0.001, 0.03),
                        lambda index=index, prompt=prompt, params=params: cluster.submit(f"r{index}", prompt, params))
    cluster.loop.run()
    return cluster


def test_a_cluster_fast_forwarded_routes_and_serves_exactly_as_one_stepped_one_step_at_a_time():
    """Reports mid-run (every 50 ms) see the steps begun by then, pulls and arrivals land mid-run, tokens
    stream with their own steps' times: the routers decide the same, every request sees the same."""
    for num_prefill in (0, 1):
        clusters = {fast: serve(fast, num_prefill) for fast in (False, True)}
        seen = {fast: [(r.arrival_s, r.token_times_s, r.num_cached_tokens, r.finished_s)
                       for _, r in sorted(cluster.records.items())] for fast, cluster in clusters.items()}
        assert seen[True] == seen[False]
        figures = {fast: [(pool.num_routed, [engine_figures(r.engine) for r in pool.replicas.values()])
                          for pool in cluster.pools()] for fast, cluster in clusters.items()}
        assert figures[True] == figures[False]
        assert sum(r.engine.runner.num_fast_forwarded_steps for r in clusters[True].decode.replicas.values()) > 0
