"""The simulator: the real scheduler in simulated time, a fitted cost model, determinism."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pd.config import EngineConfig
from pd.engine.outputs import ScheduledRequest
from pd.engine.request import Request
from pd.sampling_params import SamplingParams
from pd.workload.trace import TraceRequest
from sim.cost import CostModel, StepShape
from sim.engine import sim_engine
from sim.replica import replay, summarize

COST = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-7, per_seq_s=2e-4, per_sample_s=1e-4)
CONFIG = EngineConfig(model="builtin:tiny-llama", block_size=16, num_blocks=2048, max_num_batched_tokens=512,
                      max_num_seqs=64)


def burst(num_requests: int, shared_blocks: int = 0, every_ms: float = 1.0) -> list[TraceRequest]:
    """Requests of 4 blocks (the first ``shared_blocks`` shared by all) and 16 output tokens."""
    return [TraceRequest(timestamp_ms=i * every_ms, input_length=4 * 512, output_length=512,
                         hash_ids=tuple(range(shared_blocks)) + tuple(1000 * (i + 1) + b for b in range(4 - shared_blocks)))
            for i in range(num_requests)]


def run(trace, config=CONFIG, seed=0, block_tokens=32):
    return replay(trace, sim_engine(config, COST, seed=seed), block_tokens)


def test_a_step_shape_counts_tokens_pairs_and_samples():
    prefill = Request("a", list(range(40)), SamplingParams())
    prefill.num_computed_tokens = 16  # a second chunk of 24 after 16
    decode = Request("b", list(range(10)), SamplingParams())
    decode.num_computed_tokens = 99  # one new token at context 100
    shape = StepShape.of([ScheduledRequest(prefill, 24, samples=True), ScheduledRequest(decode, 1, samples=True)])
    assert shape == StepShape(num_tokens=25, attn_pairs=24 * 16 + 24 * 25 // 2 + 99 + 1, num_seqs=2, num_samples=2)


def test_fit_recovers_a_known_model_and_never_goes_negative():
    shapes = [StepShape(t, p, s, m) for t, p, s, m in
              [(1, 100, 1, 1), (64, 5000, 4, 4), (512, 130000, 1, 1), (16, 9000, 16, 16), (300, 20000, 8, 2),
               (2048, 2100000, 1, 1), (32, 64000, 32, 32)]]
    seconds = [COST.step_seconds(s) for s in shapes]
    fitted = CostModel.fit(shapes, seconds, "synthetic")
    for field in ("base_s", "per_token_s", "per_pair_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(COST, field), rel=1e-3)
    assert all(fitted.step_seconds(s) == pytest.approx(t, rel=1e-6) for s, t in zip(shapes, seconds))
    flat = CostModel.fit(shapes, [0.01 - 1e-9 * s.attn_pairs for s in shapes], "a falling trend")
    assert min(dataclasses.astuple(flat)[:5]) >= 0


def test_the_same_seed_gives_the_same_run():
    trace = burst(20, shared_blocks=2)
    first, second = run(trace), run(trace)
    assert [r.token_times_s for r in first] == [r.token_times_s for r in second]
    assert summarize(first) == summarize(second)


def test_steps_of_few_tokens_are_priced_on_the_decode_threads_profile():
    """A replica's decode steps compute on ``decode_threads`` (``pd.engine.model_runner.step_threads``): the
    simulated engine prices them by that count's profile, and its prefill steps by the engine's."""
    from pd import SamplingParams

    slow_decode = CostModel(base_s=0.05, per_token_s=0.0, per_pair_s=0.0, per_seq_s=0.0, per_sample_s=0.0)
    engine = sim_engine(dataclasses.replace(CONFIG, num_threads=2, decode_threads=1), COST, decode_cost=slow_decode)
    engine.add_request("a", list(range(3, 3 + 64)), SamplingParams(max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append((engine.runner.last_step_seconds, engine.runner.last_step_threads))
    assert seen[0][0] < 0.05 and seen[0][1] is None  # the 64-token prefill: the engine's threads, COST
    assert seen[1:] == [(0.05, 1)] * 2


def test_the_real_scheduler_decides_a_limit_changes_the_result():
    trace = burst(24, every_ms=0.0)
    wide = summarize(run(trace))
    narrow = summarize(run(trace, dataclasses.replace(CONFIG, max_num_seqs=2)))
    assert narrow["finished"] == wide["finished"] == 24
    assert narrow["ttft_p90_s"] > 3 * wide["ttft_p90_s"]  # 2 at a time: the rest queue
    chunked = summarize(run(trace, dataclasses.replace(CONFIG, max_num_batched_tokens=64)))
    assert chunked["ttft_p50_s"] != wide["ttft_p50_s"]


def test_shared_prefixes_hit_the_real_prefix_cache():
    records = run(burst(6, shared_blocks=3, every_ms=500.0))
    assert records[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens == 3 * 32 for r in records[1:])  # 3 shared trace blocks of 32 tokens
    alone = run(burst(6, shared_blocks=0, every_ms=500.0))
    assert summarize(records)["ttft_p50_s"] < summarize(alone)["ttft_p50_s"]


def test_the_profile_measures_the_real_engine_and_fits():
    from sim.profile import measure, median_relative_error

    shapes, seconds = measure("builtin:tiny-llama", threads=1, batch_sizes=(1, 4), prompt_lens=(32, 128), repeats=1)
    assert len(shapes) == len(seconds) > 10 and all(t > 0 for t in seconds)
    assert {s.num_tokens > s.num_seqs for s in shapes} == {True, False}  # prefill steps and decode steps
    model = CostModel.fit(shapes, seconds, "test")
    assert model.step_seconds(max(shapes, key=lambda s: s.num_tokens)) > model.step_seconds(min(shapes, key=lambda s: s.num_tokens))
    assert median_relative_error(model, shapes, seconds) < 1.0


def test_a_host_tier_runs_for_real_in_the_simulator_and_its_copies_cost_time():
    """The real host tier's decisions (demote, match, promote) on a meta pool; copies priced by ``per_host_byte_s``."""
    from pd import SamplingParams as Params

    config = dataclasses.replace(CONFIG, num_blocks=24)
    block_bytes = sim_engine(config, COST).runner.kv_cache[0].nbytes
    priced = dataclasses.replace(COST, per_host_byte_s=1e-9)
    engine = sim_engine(dataclasses.replace(config, host_kv_cache_bytes=16 * block_bytes), priced)
    assert engine.tiers.host.cache.is_meta  # no host memory is taken for it
    first = list(range(1, 130))  # 8 full blocks
    churn = [list(range(200 + 130 * k, 320 + 130 * k)) for k in range(3)]
    params = Params(max_tokens=2, temperature=0, ignore_eos=True)

    ids = itertools.count()

    def serve(tokens: list[int]) -> float:
        engine.add_request(str(next(ids)), tokens, params)
        seconds = 0.0
        while engine.has_unfinished_requests():
            engine.step()
            seconds += engine.runner.last_step_seconds
        return seconds

    serve(first)
    for tokens in churn:
        serve(tokens)
    hits = engine.stats().num_prefix_hit_tokens
    promoted = engine.stats().num_promoted_blocks
    seconds = serve(first)
    assert engine.stats().num_prefix_hit_tokens - hits == 8 * 16  # from the host tier
    assert engine.stats().num_promoted_blocks - promoted == 8
    assert seconds >= 8 * block_bytes * 1e-9  # the promotions were paid for


FIRST = list(range(1, 130))  # 8 full blocks and a token
CHURN = [list(range(130 + 125 * k, 250 + 125 * k)) for k in range(7)]  # 49 blocks: past 24 + 16


def tier_config(**tiers) -> EngineConfig:
    """24 device blocks and a host tier of 16, above ``tiers``: the disk's or the shared store's fields."""
    block_bytes = sim_engine(CONFIG, COST).runner.kv_cache[0].nbytes
    return dataclasses.replace(CONFIG, num_blocks=24, host_kv_cache_bytes=16 * block_bytes, kv_tier_write_slots=4,
                               **tiers)


DISK = {"disk_kv_cache_path": "/unused/by/the/simulator", "disk_kv_cache_bytes": 1 << 30}


def tiered(config, loop, **options):
    return sim_engine(config, COST, loop=loop, **options)


def serve_in_turn(loop, replica, prompts, prefix: str) -> list[float]:
    """Each prompt after the one before has finished: their TTFTs in simulated seconds."""
    ttfts = []
    for index, prompt in enumerate(prompts):
        first = []
        replica.on_outputs = lambda outs: first.append(loop.now) if not first and any(
            out.new_token_ids for out in outs) else None
        start = loop.now
        replica.add(f"{prefix}{index}", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        loop.run()
        ttfts.append(first[0] - start)
    return ttfts


def test_a_disk_tier_runs_for_real_in_the_simulator_and_its_reads_take_their_modelled_time():
    """The real store tier (write-through, index, loads) on modelled records: a prefix churned out of the device
    and host pools hits on disk, and a slower disk makes that first token later by its read time."""
    from sim.clock import EventLoop
    from sim.replica import SimReplica
    from sim.tiers import StoreModel, TierModels

    ttfts = {}
    for name, op_s in (("fast", 1e-4), ("slow", 0.05)):
        disk = StoreModel(read_bytes_per_s=1e9, write_bytes_per_s=1e9, op_s=op_s, source="test")
        loop = EventLoop()
        engine = tiered(tier_config(**DISK), loop, tier_models=TierModels(disk=disk))
        replica = SimReplica(loop, engine)
        *_, ttfts[name] = serve_in_turn(loop, replica, [FIRST, *CHURN, FIRST], name)
        stats = engine.stats()
        assert stats.disk_written_blocks >= 8 + 7 * 7 and stats.disk_read_blocks == 8
        assert stats.num_prefix_hit_tokens == 8 * 16  # all 8 blocks of FIRST, loaded from disk
        assert stats.num_used_blocks == 0 and not engine.has_unfinished_requests()
    # One query-free read of 8 records (a disk is not asked), ending a call of op_s: the slow disk's extra time.
    assert ttfts["slow"] - ttfts["fast"] == pytest.approx(0.05 - 1e-4, rel=0.05)


def test_a_prefix_computed_on_one_replica_hits_on_another_through_the_simulated_shared_store():
    from router.tiers import Tier
    from sim.clock import EventLoop
    from sim.replica import SimReplica
    from sim.tiers import ModelledStore

    config = tier_config(shared_kv_bucket="unused-by-the-simulator", shared_kv_bytes=1 << 30)
    loop, store = EventLoop(), ModelledStore()
    a, b = (tiered(config, loop, shared_store=store) for _ in range(2))
    serve_in_turn(loop, SimReplica(loop, a), [FIRST], "a")
    assert len(store) == 8  # written through, landed
    shared = [event for event in a.cache_events()[1] if event.stored and event.tier == Tier.SHARED]
    assert len(shared) == 8  # announced to routers as readable by every replica
    serve_in_turn(loop, SimReplica(loop, b), [FIRST], "b")
    stats = b.stats()
    assert stats.num_prefix_hit_tokens == 8 * 16 and stats.shared_read_blocks == 8
    assert stats.shared_store_queries >= 1


def test_a_simulated_store_tier_cannot_be_waited_on_and_needs_the_event_loop():
    from sim.clock import EventLoop

    with pytest.raises(ValueError, match="pass loop"):
        sim_engine(tier_config(**DISK), COST)
    engine = tiered(tier_config(**DISK), EventLoop())
    with pytest.raises(RuntimeError, match="run the loop instead"):
        engine.tiers.flush()


def test_the_simulator_refuses_a_sharded_engine_it_cannot_price():
    # Dense tensor parallelism is not priced; expert parallelism is, with attention split over its ranks.
    with pytest.raises(ValueError, match="only as expert parallelism with attention split over the same ranks"):
        sim_engine(dataclasses.replace(CONFIG, tensor_parallel_size=2), COST)


def test_the_simulator_needs_the_bytes_of_a_cuda_pool_it_cannot_measure():
    cuda = dataclasses.replace(CONFIG, device="cuda", num_blocks=None)
    with pytest.raises(ValueError, match="gpu_memory_utilization.*give engine.kv_cache_bytes or num_blocks"):
        sim_engine(cuda, COST)
    assert sim_engine(dataclasses.replace(cuda, kv_cache_bytes=1 << 24), COST).block_pool.num_blocks == (
        (1 << 24) // sim_engine(CONFIG, COST).runner.kv_cache[0].nbytes)


def test_the_event_loop_keeps_the_gc_off_what_existed_and_puts_it_back_when_done():
    import gc

    from sim.clock import RUN_GC_THRESHOLD, EventLoop

    loop, seen = EventLoop(), []
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    existing = [[index] for index in range(1000)]  # objects the cyclic GC tracks
    loop.at(1.0, lambda: seen.append((gc.get_threshold()[0], gc.get_freeze_count())))
    loop.run()
    assert seen[0][0] == RUN_GC_THRESHOLD
    assert seen[0][1] >= frozen + len(existing)  # frozen while it ran
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == frozen


def test_the_event_loop_puts_the_gc_back_when_an_event_raises():
    import gc

    from sim.clock import EventLoop

    def fail() -> None:
        raise RuntimeError("an event failed")

    loop = EventLoop()
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    loop.at(0.5, fail)
    with pytest.raises(RuntimeError, match="an event failed"):
        loop.run()
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == frozen
