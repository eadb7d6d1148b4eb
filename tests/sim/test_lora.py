"""LoRA adapters in the simulator: the engine's own admission, block-hash roots and slot policy, each load
priced; replicas report their slots; and on a Zipf trace adapter-aware routing beats adapter-blind."""

from __future__ import annotations

import random

import pytest

from pd.config import EngineConfig
from pd.model.config import load_model_config
from pd.sampling_params import SamplingParams
from router.policy import PolicyConfig
from sim.adapters import AdapterCatalog, SimAdapter, lora_bytes
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, PoolSpec, SimCluster
from sim.cost import CostModel
from sim.engine import routing_stats, sim_engine
from sim.fast_forward import run_length
from sim.lora_trace import LoraTraceConfig, generate_lora_trace, submit_lora_trace, trace_adapters
from sim.models import model_dir
from sim.placement import AffinityPlacement
from sim.replica import SimReplica
from sim.transport import TransferModel

COST = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-7, per_seq_s=2e-4, per_sample_s=1e-4,
                 per_host_byte_s=1e-9)
CONFIG = EngineConfig(model="builtin:tiny-llama", block_size=16, num_blocks=512, max_num_batched_tokens=512,
                      max_num_seqs=64, enable_lora=True, max_loras=4, max_cpu_loras=16)
CATALOG = AdapterCatalog([SimAdapter("x", 1_000_000), SimAdapter("y", 3_000_000)])


def serve_one(config: EngineConfig, cost: CostModel, requests: list[tuple[str, list[int], str | None]],
              fast_forward: bool = True):
    """``requests`` (id, prompt, adapter) added at once to one replica, served to the end."""
    loop = EventLoop()
    engine = sim_engine(config, cost, loop=loop, adapters=CATALOG)
    cached = {}

    def land(outputs) -> None:
        for output in getattr(outputs, "__iter__", lambda: [])():
            cached[output.request_id] = max(cached.get(output.request_id, 0), output.num_cached_tokens)

    replica = SimReplica(loop, engine, on_outputs=land, fast_forward=fast_forward)
    for request_id, prompt, adapter in requests:
        options = {} if adapter is None else {"lora": adapter}
        replica.add(request_id, prompt, SamplingParams(max_tokens=20, ignore_eos=True), **options)
    loop.run()
    return replica, cached


def test_requests_run_under_their_adapters_through_the_engines_own_code():
    prompt = list(range(100, 164))  # four blocks
    requests = [("x0", prompt, "x"), ("y0", prompt, "y"), ("base", prompt, None)]
    replica, _ = serve_one(CONFIG, COST, requests)
    engine = replica.engine
    # Each adapter's KV hashes from its own root: three copies of one prompt, no block shared.
    assert engine.stats().num_prefix_hit_tokens == 0
    assert engine.runner.num_adapter_loads == 2 and engine.lora.num_requests == {"x": 1, "y": 1}
    stats = routing_stats(engine)
    assert (stats.adapters, stats.max_loras) == (("x", "y"), 4)
    # A second request under x hits x's blocks.
    _, cached = serve_one(CONFIG, COST, [("x0", prompt, "x"), ("x1", prompt + [7], "x")])
    assert cached["x1"] == 64


def test_one_slot_runs_one_adapter_at_a_time_and_each_load_costs_its_bytes():
    """max_loras 1: the scheduler never runs x and y together (the slot table would refuse the step); every
    switch is a load, and the loads' bytes at the host link's rate are the only difference in busy time."""
    one_slot = EngineConfig(**{**vars(CONFIG), "max_loras": 1})
    rng = random.Random(0)
    requests = [(f"r{i}", [rng.randrange(1000) for _ in range(40)], "xy"[i % 2]) for i in range(6)]
    free = CostModel(**{**vars(COST), "per_host_byte_s": 0.0})
    priced, _ = serve_one(one_slot, COST, requests)
    unpriced, _ = serve_one(one_slot, free, requests)
    loads = priced.engine.runner.num_adapter_loads
    assert loads >= 2 and loads == unpriced.engine.runner.num_adapter_loads
    # With one slot each load is the other adapter's: x (1 MB), y (3 MB), x, ...
    moved_bytes = sum((1_000_000, 3_000_000)[load % 2] for load in range(loads))
    assert priced.busy_s - unpriced.busy_s == pytest.approx(moved_bytes * 1e-9)


def test_fast_forward_with_adapters_serves_exactly_as_stepping():
    rng = random.Random(2)
    requests = [(f"r{i}", [rng.randrange(1000) for _ in range(rng.choice((30, 200)))], rng.choice(("x", "y", None)))
                for i in range(12)]
    runs = {}
    for fast in (False, True):
        replica, cached = serve_one(CONFIG, COST, requests, fast_forward=fast)
        runner = replica.engine.runner
        runs[fast] = (replica.busy_s, cached, runner.num_adapter_loads, runner.lora_slots.held, runner.num_steps)
        assert (runner.num_fast_forwarded_steps > 0) == fast
    assert runs[True] == runs[False]


def test_a_disaggregated_cluster_with_adapters_fast_forwarded_serves_exactly_as_stepping():
    """A decode whose KV was pulled joins the running batch without a step of its own: the run waits for the
    engine's step to load its adapter."""
    link = TransferModel(per_transfer_s=1e-3, per_descriptor_s=1e-5, bytes_per_s=2e9)
    seen = {}
    for fast in (False, True):
        rng = random.Random(1)
        cluster = SimCluster(EventLoop(), ClusterSpec(
            decode=PoolSpec(2, CONFIG, COST), prefill=PoolSpec(1, CONFIG, COST), transfer=link, call_s=0.001,
            report_period_s=0.05, adapters=(SimAdapter("x", 1_000_000), SimAdapter("y", 3_000_000))))
        for replica in (*cluster.decode.replicas.values(), *cluster.prefill.replicas.values()):
            replica.fast_forward = fast
        for index in range(30):
            prompt = [rng.randrange(1, 1000) for _ in range(rng.choice((30, 600)))]
            params = SamplingParams(max_tokens=rng.choice((5, 40, 150)), ignore_eos=True)
            adapter = rng.choice(("x", "y", None))
            cluster.loop.at(index * rng.uniform(0.001, 0.03), lambda index=index, prompt=prompt, params=params,
                            adapter=adapter: cluster.submit(f"r{index}", prompt, params, adapter))
        cluster.loop.run()
        seen[fast] = ([(r.token_times_s, r.num_cached_tokens) for _, r in sorted(cluster.records.items())],
                      cluster.decode.num_adapter_loads, cluster.prefill.num_adapter_loads)
        fast_forwarded = sum(r.engine.runner.num_fast_forwarded_steps for r in cluster.decode.replicas.values())
        assert (fast_forwarded > 0) == fast
    assert seen[True] == seen[False]
    assert cluster.network.num_reads > 0 and seen[True][1] > 0
    decode = [replica.engine.stats() for replica in cluster.decode.replicas.values()]
    assert sum(stats.num_remote_pulls for stats in decode) == cluster.network.num_reads
    assert sum(stats.num_recompute_fallbacks for stats in decode) == 0  # the handles name the adapters


def test_no_run_is_fast_forwarded_while_an_adapter_of_the_batch_is_out_of_its_slot():
    """A run's steps load nothing: the engine's own step loads the adapter first."""
    engine = sim_engine(CONFIG, COST, adapters=CATALOG)
    engine.add_request("r", list(range(40)), SamplingParams(max_tokens=50, ignore_eos=True), lora="x")
    engine.step()
    assert run_length(engine) > 0
    engine.runner.lora_slots.drop(CATALOG.key("x"))
    assert run_length(engine) == 0
    engine.step()
    assert engine.runner.num_adapter_loads == 2 and run_length(engine) > 0


def test_adapters_need_engines_that_serve_them():
    plain = EngineConfig(**{**vars(CONFIG), "enable_lora": False})
    with pytest.raises(ValueError, match="enable_lora"):
        ClusterSpec(decode=PoolSpec(1, plain, COST), adapters=(SimAdapter("x", 1),))
    with pytest.raises(KeyError, match="no simulated adapter 'z'"):
        CATALOG.key("z")
    with pytest.raises(ValueError, match="named twice"):
        AdapterCatalog([SimAdapter("x", 1), SimAdapter("x", 2)])


def test_host_memory_holds_max_cpu_loras_and_an_evicted_adapter_is_read_again_by_the_sims_loader():
    few = EngineConfig(**{**vars(CONFIG), "max_loras": 2, "max_cpu_loras": 2})
    engine = sim_engine(few, COST, adapters=AdapterCatalog([SimAdapter(f"a{i}", 1) for i in range(3)]))
    assert engine.stats().num_loras_loaded == 3 and engine.stats().num_loras_in_memory == 2  # a0 evicted
    engine.add_request("r", list(range(100, 140)), SamplingParams(max_tokens=2), lora="a0")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_lora_loads == 4  # a0 read again


def test_a_rank_16_adapter_of_llama_3_8b_is_about_84_mb():
    assert lora_bytes(load_model_config(model_dir("llama-3-8b")), 16) == 83_886_080


def serve_trace(adapter_hints: bool) -> SimCluster:
    trace = LoraTraceConfig(num_requests=600, rate_per_s=60.0, system_prompt_tokens=256, tail_tokens=(128, 1024),
                            output_tokens=(8, 32), seed=0)
    loop = EventLoop()
    spec = ClusterSpec(decode=PoolSpec(8, CONFIG, COST), adapters=trace_adapters(trace, 2_000_000),
                       adapter_hints=adapter_hints, call_s=0.001)
    cluster = SimCluster(loop, spec, AffinityPlacement(PolicyConfig(block_size=CONFIG.block_size)))
    submit_lora_trace(cluster, generate_lora_trace(trace, vocab_size=1000))
    loop.run()
    return cluster


@pytest.mark.slow  # two simulated clusters on a Zipf trace: 4 s on 2 cores
def test_on_a_zipf_trace_adapter_aware_routing_hits_more_and_loads_less_within_the_load_bound():
    """16 adapters of Zipf popularity, 8 replicas of 4 slots: naming the adapter in the hints keeps each on few
    replicas, so more of its system prompt stays cached and fewer slots turn over; the bound holds."""
    results = {}
    for hints in (True, False):
        cluster = serve_trace(hints)
        records = list(cluster.records.values())
        assert len(records) == 600 and all(record.finished_s is not None for record in records)
        routed = [cluster.decode.num_routed[replica_id] for replica_id in cluster.decode.replica_ids]
        results[hints] = (sum(r.num_cached_tokens for r in records) / sum(r.num_prompt_tokens for r in records),
                          cluster.decode.num_adapter_loads, max(routed) / min(routed))
    (aware_hits, aware_loads, aware_ratio), (blind_hits, blind_loads, _) = results[True], results[False]
    assert aware_hits > blind_hits
    assert aware_loads < blind_loads
    assert aware_ratio <= 1.5
