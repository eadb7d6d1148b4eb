"""An MoE step's price: active parameters per token, and the experts a step's tokens touch read once each."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from pd.config import EngineConfig
from pd.model.config import load_model_config
from sim.cost import CostModel, ExpertReads, StepShape
from sim.hardware import (
    HARDWARE,
    MODELS,
    analytic_cost,
    expert_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    link,
    model_dir,
    num_active_params,
    num_params,
    weight_bytes,
)
from sim.plan import Layout, Slo, attainment, run, synthetic, unit_spec

CONFIGS = Path(__file__).resolve().parents[2] / "serve_configs"
H200 = HARDWARE["h200"]
MOE = "qwen3-30b-a3b"
DECODE_ONE = StepShape(num_tokens=1, attn_pairs=2048, num_seqs=1, num_samples=1)
PREFILL_4K = StepShape(num_tokens=4096, attn_pairs=4096 * 4097 // 2, num_seqs=1, num_samples=1)

# The dense presets' analytic H200 profiles and step times as computed before MoE pricing existed.
DENSE_BEFORE = {
    "llama-3-8b": dict(num_params=6979321856, kv_cache_bytes=112446008985, base_s=0.005182289066666667,
                       per_token_s=2.8227793148634985e-05, per_pair_s=1.7670643747893496e-09,
                       per_sample_s=2.1247182042467137e-06, decode_s=0.005226260525859117,
                       prefill_s=0.1356422838203923),
    "qwen2.5-7b": dict(num_params=6525288448, kv_cache_bytes=113192490240, base_s=0.004966293333333333,
                       per_token_s=2.6391459850353893e-05, per_pair_s=1.3529086619480958e-09,
                       per_sample_s=2.2042361011122344e-06, decode_s=0.005007659786224469,
                       prefill_s=0.12442970829831075),
}


@pytest.mark.parametrize("name", sorted(DENSE_BEFORE))
def test_a_dense_models_profile_and_step_times_are_unchanged(name):
    before = DENSE_BEFORE[name]
    config = load_model_config(model_dir(name))
    cost = analytic_cost(config, H200)
    assert config.moe is None and cost.experts is None
    assert num_params(config) == num_active_params(config) == before["num_params"]
    assert kv_cache_bytes(config, H200) == before["kv_cache_bytes"]
    for field in ("base_s", "per_token_s", "per_pair_s", "per_sample_s"):
        assert getattr(cost, field) == pytest.approx(before[field], rel=1e-12), field
    assert cost.step_seconds(DECODE_ONE) == pytest.approx(before["decode_s"], rel=1e-12)
    assert cost.step_seconds(PREFILL_4K) == pytest.approx(before["prefill_s"], rel=1e-12)


def test_the_moe_preset_has_qwen3_30b_a3bs_total_and_active_parameters():
    config = load_model_config(model_dir(MOE))
    assert config.architecture == "Qwen3MoeForCausalLM" and config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.num_moe_layers) == (128, 8, 48)
    embeddings = 2 * config.hidden_size * config.vocab_size  # input embeddings and the (untied) LM head
    # The model card: 30.5B parameters in all, 3.3B activated per token (both counting the embeddings).
    assert num_params(config) + embeddings == pytest.approx(30.5e9, rel=0.02)
    assert num_active_params(config) + embeddings == pytest.approx(3.3e9, rel=0.03)
    # Memory holds every expert: about 61 GB of bf16 weights, and the rest of the H200 is KV.
    assert weight_bytes(config) == 2 * (num_params(config) + embeddings)
    assert weight_bytes(config) == pytest.approx(61e9, rel=0.01)
    assert kv_cache_bytes(config, H200) == int((H200.hbm_bytes - weight_bytes(config)) * 0.9)
    assert kv_bytes_per_token(config) == 48 * 2 * 4 * 128 * 2


def test_a_decode_step_reads_top_k_experts_a_layer_and_a_long_prefill_reads_them_all():
    config = load_model_config(model_dir(MOE))
    cost = analytic_cost(config, H200)
    experts = cost.experts
    assert experts is not None and (experts.num_layers, experts.num_experts, experts.top_k) == (48, 128, 8)
    every_expert_s = experts.num_layers * experts.num_experts * experts.per_expert_s
    assert every_expert_s == pytest.approx(expert_bytes(config) / (H200.hbm_bytes_per_s * 0.8), rel=1e-12)
    assert experts.distinct_experts(0) == 0
    assert experts.distinct_experts(1) == pytest.approx(8)
    assert experts.seconds(1) == pytest.approx(every_expert_s * 8 / 128)  # k/E of the expert bytes
    assert experts.distinct_experts(4096) == pytest.approx(128, rel=1e-9)  # every expert
    assert experts.seconds(4096) == pytest.approx(every_expert_s, rel=1e-9)
    counts = [experts.distinct_experts(t) for t in (1, 2, 4, 16, 64, 256, 10**6)]
    assert counts == sorted(counts) and counts[-1] <= 128
    # The step's time is the linear terms plus the expert reads.
    linear = dict(vars(cost), experts=None)
    assert cost.step_seconds(DECODE_ONE) == pytest.approx(CostModel(**linear).step_seconds(DECODE_ONE)
                                                          + experts.seconds(1))
    # A one-token decode reads 1/16 of the experts: far cheaper than a dense model of the same total size,
    # and its compute is the 3B active parameters, not the 30B.
    assert cost.step_seconds(DECODE_ONE) < weight_bytes(config) / (H200.hbm_bytes_per_s * 0.8) / 4
    assert cost.per_token_s == pytest.approx(2 * num_active_params(config) / (H200.bf16_flops * 0.5))


def test_an_moe_profile_survives_json_and_an_old_profile_still_loads(tmp_path):
    cost = analytic_cost(load_model_config(model_dir(MOE)), H200)
    path = tmp_path / "profile.json"
    path.write_text(cost.to_json())
    assert CostModel.load(path) == cost
    dense = CostModel(base_s=0.002, per_token_s=5e-5, per_pair_s=1e-7, per_seq_s=2e-4, per_sample_s=1e-4)
    path.write_text(json.dumps({k: v for k, v in asdict(dense).items() if k != "experts"}))  # before MoE
    assert CostModel.load(path) == dense
    with pytest.raises(ValueError, match="top_k"):
        ExpertReads(num_layers=1, num_experts=4, top_k=5, per_expert_s=1e-6)


def test_a_simulated_unit_serves_the_moe_preset_on_h200():
    config = load_model_config(model_dir(MOE))
    engine = EngineConfig(model=model_dir(MOE), dtype="bfloat16", block_size=64,
                          kv_cache_bytes=kv_cache_bytes(config, H200), max_num_seqs=256)
    spec = unit_spec(Layout(1, 1, 256, 8192), engine, analytic_cost(config, H200), link(H200, "rdma"))
    cluster = run(spec, synthetic("short-long", 40, seed=0), rate=2.0, seconds=5.0)
    assert cluster.records and all(record.finished_s is not None for record in cluster.records.values())
    assert attainment(cluster, Slo(ttft_s=0.5, itl_s=0.05)) == 1.0
    assert MOE in MODELS


def test_the_moe_serve_config_fits_one_h200_and_runs_in_the_simulator():
    """``gpu_qwen3_30b_a3b.yaml``'s replica: every expert's weights and its KV on one H200, served simulated."""
    from pd.sampling_params import SamplingParams
    from sim.clock import EventLoop
    from sim.cluster import SimCluster
    from sim.deployment import cluster_spec

    args = yaml.safe_load((CONFIGS / "gpu_qwen3_30b_a3b.yaml").read_text())["applications"][0]["args"]
    assert args["engine"]["model"].startswith("/path/to/")  # a placeholder to fill in
    assert "kv_cache_bytes" not in args["engine"]  # the pool is what the device's share leaves
    config = load_model_config(model_dir(MOE))
    utilization = args["engine"].get("gpu_memory_utilization", EngineConfig.gpu_memory_utilization)
    room = H200.hbm_bytes * utilization - weight_bytes(config)
    assert room > 48 * 2**30  # activations, CUDA graphs, the MoE's workspace, and hundreds of thousands of tokens of KV
    # The simulator measures no device: it is given the pool an H200 leaves after the weights.
    args["engine"] = {**args["engine"], "model": model_dir(MOE), "kv_cache_bytes": kv_cache_bytes(config, H200)}
    spec = cluster_spec(args, lambda threads: analytic_cost(config, H200), link(H200, "nvlink"))
    assert spec.prefill.num_replicas == spec.decode.num_replicas == 2
    loop = EventLoop()
    cluster = SimCluster(loop, spec)
    for index in range(8):
        cluster.submit(f"r{index}", list(range(1 + index, 2000 + index)), SamplingParams(max_tokens=16, ignore_eos=True))
    loop.run()
    assert all(record.finished_s is not None for record in cluster.records.values())
