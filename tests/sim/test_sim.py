"""The simulator: the real scheduler in simulated time, a fitted cost model, determinism."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from bench.trace import TraceRequest
from pd.config import EngineConfig
from pd.engine.outputs import ScheduledRequest
from pd.engine.request import Request
from pd.sampling_params import SamplingParams
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


def test_the_simulator_refuses_the_tiers_it_does_not_model(tmp_path):
    with pytest.raises(ValueError, match="not the disk tier or the shared store"):
        sim_engine(dataclasses.replace(CONFIG, host_kv_cache_bytes=1 << 20, disk_kv_cache_path=str(tmp_path),
                                       disk_kv_cache_bytes=1 << 20), COST)


def test_the_simulator_refuses_a_sharded_engine():
    with pytest.raises(ValueError, match="one engine on one device: set tensor_parallel_size to 1"):
        sim_engine(dataclasses.replace(CONFIG, tensor_parallel_size=2), COST)
