"""Configs in, configs out: the app's YAML read by its own schema, analytic profiles, the planner's YAML."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from pd.config.app import AppArgs
from pd.model.config import load_model_config
from sim.cost import CostModel, StepShape
from sim.deployment import cluster_spec
from sim.hardware import HARDWARE, MODELS, analytic_cost, kv_cache_bytes, link, model_dir, num_params
from sim.plan import Layout, Slo, attainment, fleet_yaml, max_goodput, synthetic, unit_spec
from sim.transport import LINKS

CONFIGS = Path(__file__).resolve().parents[2] / "serve_configs"
COST = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-7, per_seq_s=2e-4, per_sample_s=1e-4)


def app_args(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())["applications"][0]["args"]


def test_a_serve_config_becomes_its_cluster():
    costs = {1: COST, 2: dataclasses.replace(COST, base_s=COST.base_s / 2)}
    default = cluster_spec(app_args("default.yaml"), costs.__getitem__, LINKS["loopback"])
    assert default.prefill.num_replicas == default.decode.num_replicas == 1
    assert default.prefill.cost == COST  # num_cpus 0.5: one thread
    assert default.rule.threshold == 256 and default.rule.queue_bound == 32
    assert default.prefill_router == "router.serve:PredictedLatencyRouter"  # the app's default
    affinity = app_args("default.yaml")
    affinity["prefill"]["router"] = {"request_router_class": "router.serve:PrefixAffinityRouter"}
    assert cluster_spec(affinity, costs.__getitem__, LINKS["loopback"]).prefill_router == \
        "router.serve:PrefixAffinityRouter"
    affinity["prefill"]["router"] = {"request_router_class": "router.serve:PinnedRequestRouter"}
    with pytest.raises(ValueError, match="the simulator runs the project's own routers only"):
        cluster_spec(affinity, costs.__getitem__, LINKS["loopback"])
    colocated = cluster_spec(app_args("colocated.yaml"), costs.__getitem__, LINKS["loopback"])
    assert colocated.prefill is None and colocated.decode.cost == costs[2]  # num_cpus 1.5: two threads
    # ... and one for its steps of few tokens, as pd.serve.engine_server.replica_decode_threads gives it
    assert colocated.decode.decode_cost == costs[1] and colocated.decode.engine.decode_threads == 1
    assert default.decode.decode_cost == COST and default.decode.engine.decode_threads == 1
    given = cluster_spec({**app_args("colocated.yaml"), "engine": {**app_args("colocated.yaml")["engine"],
                                                                    "decode_threads": 2}},
                         costs.__getitem__, LINKS["loopback"])
    assert given.decode.decode_cost == costs[2]
    pinned = cluster_spec({**app_args("colocated.yaml"), "engine": {**app_args("colocated.yaml")["engine"],
                                                                     "num_threads": 1}},
                          costs.__getitem__, LINKS["loopback"])
    assert pinned.decode.cost == pinned.decode.decode_cost == COST  # a replica given its threads keeps them
    with pytest.raises(ValueError, match="remote_prefill_treshold"):
        cluster_spec({**app_args("default.yaml"), "remote_prefill_treshold": 5}, costs.__getitem__, LINKS["loopback"])


def test_the_default_prefill_router_predicts_latency_and_the_prefix_affinity_one_can_be_named():
    args, affinity = app_args("default.yaml"), "router.serve:PrefixAffinityRouter"
    options = AppArgs.parse(args).deployment_options("prefill")["request_router_config"]
    assert options.request_router_class == "router.serve:PredictedLatencyRouter"
    args["prefill"]["router"] = {"request_router_class": affinity, "request_router_kwargs": {"max_routed_ratio": 1.6}}
    options = AppArgs.parse(args).deployment_options("prefill")["request_router_config"]
    assert (options.request_router_class, options.request_router_kwargs["max_routed_ratio"]) == (affinity, 1.6)


def test_the_tiered_config_runs_in_the_simulator_with_its_disk_tier_modelled(tmp_path):
    """``tiered.yaml``'s disk tier is the real store tier on modelled records: no file is written."""
    from pd.sampling_params import SamplingParams
    from sim.clock import EventLoop
    from sim.cluster import SimCluster

    args = app_args("tiered.yaml")
    args["engine"] = {**args["engine"], "disk_kv_cache_path": str(tmp_path / "never-written")}
    spec = cluster_spec(args, lambda threads: COST, LINKS["loopback"])
    loop = EventLoop()
    cluster = SimCluster(loop, spec)
    for index in range(4):
        cluster.submit(f"r{index}", list(range(1 + index, 400 + index)), SamplingParams(max_tokens=4, ignore_eos=True))
    loop.run()
    assert all(record.finished_s is not None for record in cluster.records.values())
    engines = [replica.engine for pool in (cluster.prefill, cluster.decode) for replica in pool.replicas.values()]
    assert sum(engine.stats().disk_written_blocks for engine in engines) > 0
    assert not (tmp_path / "never-written").exists()


def test_the_analytic_profile_follows_the_roofline():
    config = load_model_config(model_dir("llama-3-8b"))
    assert 6.5e9 < num_params(config) < 7.5e9  # Llama-3-8B without its embeddings
    h100, h200 = (analytic_cost(config, HARDWARE[name]) for name in ("h100", "h200"))
    assert h100.source.startswith("analytic")
    decode = StepShape(num_tokens=64, attn_pairs=64 * 2048, num_seqs=64, num_samples=64)
    prefill = StepShape(num_tokens=8192, attn_pairs=8192 * 4096, num_seqs=1, num_samples=1)
    assert h200.step_seconds(decode) < h100.step_seconds(decode)  # more HBM bandwidth
    assert h200.step_seconds(prefill) == pytest.approx(h100.step_seconds(prefill), rel=0.05)  # the same FLOP/s
    assert 3e-3 < h200.step_seconds(decode) < 20e-3
    assert kv_cache_bytes(config, HARDWARE["h200"]) > 100e9
    assert set(MODELS) >= {"llama-3-8b"}


@pytest.mark.slow  # two plans, each searching its layouts in simulation: 3.5 s on 2 cores
def test_a_looser_slo_never_plans_less_goodput():
    trace = synthetic("long-short", 400, seed=1)
    config = load_model_config(model_dir("llama-3-8b"))
    from pd.config import EngineConfig

    engine = EngineConfig(model=model_dir("llama-3-8b"), dtype="bfloat16", block_size=64,
                          kv_cache_bytes=kv_cache_bytes(config, HARDWARE["h200"]), max_num_seqs=256)
    spec = unit_spec(Layout(0, 2, 256, 8192), engine, analytic_cost(config, HARDWARE["h200"]),
                     link(HARDWARE["h200"], "rdma"))
    tight, _ = max_goodput(spec, trace, Slo(ttft_s=0.6, itl_s=0.05), seconds=9, steps=1)
    loose, _ = max_goodput(spec, trace, Slo(ttft_s=3.0, itl_s=0.05), seconds=9, steps=1)
    assert 0 < tight <= loose and math.isfinite(loose)


def test_the_planned_yaml_passes_the_apps_own_checks():
    config = load_model_config(model_dir("llama-3-8b"))
    from pd.config import EngineConfig

    engine = EngineConfig(model=model_dir("llama-3-8b"), dtype="bfloat16",
                          kv_cache_bytes=kv_cache_bytes(config, HARDWARE["h200"]))
    document = fleet_yaml(Layout(3, 5, 1024, 8192), "llama-3-8b", engine, units=125)
    args = AppArgs.parse(document["applications"][0]["args"])
    assert (args.prefill.num_replicas, args.decode.num_replicas) == (375, 625)
    assert args.remote_prefill_threshold == 1024 and args.mode == "disaggregated"
    colocated = fleet_yaml(Layout(0, 8, 256, 8192), "llama-3-8b", engine, units=125)["applications"][0]["args"]
    assert AppArgs.parse(colocated).mode == "colocated" and colocated["decode"]["num_replicas"] == 1000


def test_each_ingress_of_the_planned_fleet_decides_as_the_simulated_units_one_did():
    # A unit is simulated with one ingress; the fleet's 31 ingress replicas each see about 4 units' calls.
    config = load_model_config(model_dir("llama-3-8b"))
    from pd.config import EngineConfig

    engine = EngineConfig(model=model_dir("llama-3-8b"), dtype="bfloat16",
                          kv_cache_bytes=kv_cache_bytes(config, HARDWARE["h200"]))
    layout = Layout(6, 2, 256, 8192, threshold_per_in_flight=1024.0)
    unit_rule = unit_spec(layout, engine, COST, LINKS["loopback"]).rule
    args = AppArgs.parse(fleet_yaml(layout, "llama-3-8b", engine, units=125)["applications"][0]["args"])
    fleet_rule, units_per_ingress = args.remote_prefill_rule(), 125 / args.ingress.num_replicas
    for in_flight in (0, 3, 6, 12, 31, 32, 40):
        seen = round(in_flight * units_per_ingress)
        for uncached in (300, 4000, 8000, 16000):
            assert fleet_rule.wants_remote(20000, uncached, seen) == unit_rule.wants_remote(20000, uncached, in_flight)


def test_a_stall_after_the_first_token_misses_the_slo_whatever_the_mean():
    from types import SimpleNamespace

    from sim.replica import RequestRecord

    def served(token_times_s):
        return RequestRecord(0.0, 100, token_times_s=token_times_s, finished_s=token_times_s[-1])

    steady = served([0.1 + 0.02 * i for i in range(1000)])
    # The first token at once (a remote prefill), then 10 s queued on the decode replica: the mean gap
    # over 1,000 tokens is 30 ms, within the 50 ms target.
    stalled = served([0.1, 10.1] + [10.1 + 0.02 * i for i in range(1, 999)])
    slo = Slo(0.5, 0.05)
    assert sum(stalled.itls_s()) / len(stalled.itls_s()) <= slo.itl_s
    assert attainment(SimpleNamespace(records={"a": steady}), slo) == 1.0
    assert attainment(SimpleNamespace(records={"a": steady, "b": stalled}), slo) == 0.5
