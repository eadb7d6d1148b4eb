"""Expert parallelism priced: a replica over several GPUs, its experts spread, on its busiest rank."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch
import yaml

from pd.config import EngineConfig
from pd.config.app import AppArgs
from pd.engine.kv_layout import kv_block_bytes
from pd.model.config import load_model_config
from sim.cost import CostModel, StepShape
from sim.engine import sim_engine
from sim.ep_predict import predict_expert_parallel
from sim.expert_parallel import ExpertParallel, all_reduce_bytes_per_token, all_to_all_bytes_per_token, collectives
from sim.hardware import (
    HARDWARE,
    MODELS,
    analytic_cost,
    expert_bytes,
    kv_cache_bytes,
    model_dir,
    rank_weight_bytes,
    routed_params_per_token,
    weight_bytes,
)
from sim.plan import Layout, fleet_yaml, main

H200 = HARDWARE["h200"]
MOE = "qwen3-30b-a3b"
SHAPES = [StepShape(1, 2048, 1, 1), StepShape(64, 64 * 2048, 64, 64), StepShape(4096, 4096 * 4097 // 2, 1, 1)]

# qwen3-30b-a3b's analytic H200 profile and step times as computed before expert parallelism was priced.
MOE_BEFORE = dict(base_s=0.0018025429333333332, per_token_s=1.104344551668352e-05,
                  per_pair_s=2.6505965621840243e-09, per_sample_s=1.2585032477249748e-06, per_expert_s=2.4576e-06,
                  kv_cache_bytes=71942558976, steps_s=[0.002773991703857095, 0.01843405068967507,
                                                       0.08438749262098551])


@pytest.fixture(scope="module")
def qwen3():
    return load_model_config(model_dir(MOE))


def small_moe(tmp_path, **overrides):
    """A Qwen3-MoE of 2 layers, hidden 64, 8 experts of which 2 a token."""
    fields = {**MODELS[MOE], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return load_model_config(tmp_path)


def test_the_all_to_all_sends_top_k_activations_a_token_each_way_off_the_rank(tmp_path):
    model = small_moe(tmp_path)
    # dispatch and combine: 2 * k * H * bytes * (n-1)/n per token of a rank's slice, per MoE layer
    assert all_to_all_bytes_per_token(model, 4) == 2 * 2 * 64 * 2 * 3 / 4 == 384
    assert all_to_all_bytes_per_token(model, 1) == 0
    assert all_reduce_bytes_per_token(model, 4) == 2 * 64 * 2 * 3 / 4 == 192
    step = collectives(model, 4, link_bytes_per_s=1e9, latency_s=1e-5, dispatch="all_to_all")
    # Per MoE layer: attention's all-reduce, the split sizes' all-to-all, dispatch, combine and the block's
    # all-reduce; then the embedding's all-reduce and the logits' gather. A rank's slice is a quarter of
    # the step's tokens.
    assert step.num_collectives == 5 * 2 + 2
    assert step.bytes_per_token == 2 * (384 / 4 + 2 * 192) + 192
    assert step.bytes_per_sample == 4 * 1000 * 3 / 4
    assert step.seconds(100, 3) == pytest.approx(12 * 1e-5 + (100 * 1152 + 3 * 3000) / 1e9)
    whole = collectives(model, 4, link_bytes_per_s=1e9, latency_s=1e-5, attention_split=False, dispatch="all_to_all")
    assert (whole.num_collectives, whole.bytes_per_token, whole.bytes_per_sample) == (4 * 2, 2 * (96 + 192), 0)
    # The engine's default: one all-gather of the routing (16 bytes a decision, k a token) in place of three.
    step = collectives(model, 4, link_bytes_per_s=1e9, latency_s=1e-5)
    assert step.num_collectives == 3 * 2 + 2
    assert step.bytes_per_token == 2 * (16 * 2 * 3 / 4 + 2 * 192) + 192
    whole = collectives(model, 4, link_bytes_per_s=1e9, latency_s=1e-5, attention_split=False)
    assert (whole.num_collectives, whole.bytes_per_token) == (2 * 2, 2 * (24 + 192))


def test_qwen3_30b_a3b_at_ep_8_sends_56_kib_a_token_of_its_slice_per_layer(qwen3):
    assert all_to_all_bytes_per_token(qwen3, 8) == 2 * 8 * 2048 * 2 * 7 / 8 == 57344
    step = analytic_cost(qwen3, H200, parallel=ExpertParallel(8, dispatch="all_to_all")).collectives
    assert step.link_bytes_per_s == 450e9 and step.latency_s == 10e-6
    assert step.num_collectives == 5 * 48 + 2
    assert step.bytes_per_token == 48 * (57344 / 8 + 2 * 7168) + 7168 == 1039360
    step = analytic_cost(qwen3, H200, parallel=ExpertParallel(8)).collectives  # all_reduce: 0.67x the bytes
    assert step.num_collectives == 3 * 48 + 2
    assert step.bytes_per_token == 48 * (16 * 8 * 7 / 8 + 2 * 7168) + 7168 == 700672


def test_expert_parallelism_1_is_todays_pricing_exactly(qwen3):
    cost = analytic_cost(qwen3, H200)
    assert analytic_cost(qwen3, H200, parallel=ExpertParallel(1)) == cost
    assert cost.collectives is None and cost.experts.num_ranks == 1 and cost.experts.balancedness == 1.0
    for field in ("base_s", "per_token_s", "per_pair_s", "per_sample_s"):
        assert getattr(cost, field) == MOE_BEFORE[field], field
    assert cost.experts.per_expert_s == MOE_BEFORE["per_expert_s"]
    assert [cost.step_seconds(shape) for shape in SHAPES] == MOE_BEFORE["steps_s"]
    assert rank_weight_bytes(qwen3) == weight_bytes(qwen3)
    assert kv_cache_bytes(qwen3, H200) == kv_cache_bytes(qwen3, H200, parallel=ExpertParallel()) \
        == MOE_BEFORE["kv_cache_bytes"]


def test_ep_2_halves_each_ranks_expert_reads_and_memory(qwen3):
    one, two = (analytic_cost(qwen3, H200, parallel=ExpertParallel(n)) for n in (1, 2))
    for tokens in (1, 8, 64, 4096):
        assert two.experts.rank_experts(tokens) == pytest.approx(one.experts.distinct_experts(tokens) / 2)
        assert two.experts.seconds(tokens) == pytest.approx(one.experts.seconds(tokens) / 2, rel=1e-12)
    assert two.per_pair_s == pytest.approx(one.per_pair_s / 2) and two.per_token_s == pytest.approx(one.per_token_s / 2)
    assert two.base_s < one.base_s
    # Each rank holds half the experts (plus R/2 redundant ones) and about half the rest; the KV pool grows.
    held = rank_weight_bytes(qwen3, ExpertParallel(2))
    assert held == pytest.approx(weight_bytes(qwen3) / 2, rel=1e-3)
    redundant = rank_weight_bytes(qwen3, ExpertParallel(2, num_redundant_experts=2))
    assert redundant - held == expert_bytes(qwen3) // 128  # one more expert of every layer a rank
    assert kv_cache_bytes(qwen3, H200, parallel=ExpertParallel(2)) > kv_cache_bytes(qwen3, H200)
    with pytest.raises(ValueError, match="do not divide over 3 expert-parallel ranks"):
        analytic_cost(qwen3, H200, parallel=ExpertParallel(3))


def test_a_balancedness_of_one_half_doubles_the_expert_time(qwen3):
    balanced = analytic_cost(qwen3, H200, parallel=ExpertParallel(2))
    skewed = analytic_cost(qwen3, H200, parallel=ExpertParallel(2, balancedness=0.5))
    dense_flops = H200.bf16_flops * 0.5
    for shape in SHAPES:
        tokens = shape.num_tokens
        assert skewed.experts.seconds(tokens) == pytest.approx(2 * balanced.experts.seconds(tokens))
        # the busiest rank's expert time, reads and FLOPs, at perfect balance: it is added once more
        expert_s = balanced.experts.seconds(tokens) + tokens * 2 * routed_params_per_token(qwen3) / 2 / dense_flops
        assert skewed.step_seconds(shape) - balanced.step_seconds(shape) == pytest.approx(expert_s, rel=1e-9)


def test_an_ep_profile_survives_json(tmp_path, qwen3):
    cost = analytic_cost(qwen3, H200, parallel=ExpertParallel(4, num_redundant_experts=4, balancedness=0.8))
    path = tmp_path / "profile.json"
    path.write_text(cost.to_json())
    assert CostModel.load(path) == cost


def test_an_ep_replica_is_one_engine_holding_every_ranks_blocks(qwen3):
    per_rank = kv_cache_bytes(qwen3, H200, parallel=ExpertParallel(2))
    config = EngineConfig(model=model_dir(MOE), dtype="bfloat16", block_size=64, kv_cache_bytes=per_rank,
                          tensor_parallel_size=2, expert_parallel_size=2)
    engine = sim_engine(config, analytic_cost(qwen3, H200, parallel=ExpertParallel(2)))
    # each rank holds 2 of the 4 KV heads of every block, so its bytes hold twice one GPU's blocks
    assert engine.scheduler_config.num_blocks == per_rank // kv_block_bytes(qwen3, 64, torch.bfloat16, 2)
    with pytest.raises(ValueError, match="needs a cost priced for them"):
        sim_engine(config, analytic_cost(qwen3, H200))
    with pytest.raises(ValueError, match="must be equal"):
        sim_engine(dataclasses.replace(config, tensor_parallel_size=1), analytic_cost(qwen3, H200,
                                                                                      parallel=ExpertParallel(2)))


def test_the_planned_yaml_names_each_pools_expert_parallel_size(qwen3):
    engine = EngineConfig(model=model_dir(MOE), dtype="bfloat16", kv_cache_bytes=kv_cache_bytes(qwen3, H200))
    layout = Layout(3, 1, 256, 8192, prefill_ep=2, decode_ep=2)
    assert layout.name == "6:2 EP 2:2" and layout.num_gpus == 8
    args = AppArgs.parse(fleet_yaml(layout, MOE, engine, units=10, num_redundant_experts=2)["applications"][0]["args"])
    assert (args.prefill.num_replicas, args.decode.num_replicas) == (30, 10)
    for pool in (args.prefill, args.decode):
        assert (pool.tensor_parallel_size, pool.expert_parallel_size, pool.num_redundant_experts) == (2, 2, 2)
        assert pool.num_ranks == 2
    assert Layout(0, 4, 256, 8192, decode_ep=2).name == "colocated:8 EP 2"


@pytest.mark.slow  # four layouts simulated by the planner: 3 s on 2 cores
def test_sim_plan_chooses_each_pools_expert_parallel_size():
    # Prompts of 6k to 10k tokens and a 200 ms TTFT: one H200 prefills 8k tokens of Qwen3-30B-A3B in
    # about 150 ms, two with EP 2 in about 100 ms; with a 10k prompt's second chunk and its KV's transfer
    # only prefill EP 2 meets the SLO.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--model", MOE, "--hardware", "h200", "--gpus", "8", "--unit-gpus", "4", "--splits", "2",
              "--prefill-ep", "1,2", "--decode-ep", "1,2", "--seconds", "3", "--bisection-steps", "0",
              "--workload", "long-short", "--block-size", "64", "--slo-ttft-ms", "200"])
    lines = out.getvalue().splitlines()
    results = [json.loads(line) for line in lines if line.startswith("{")]
    layouts = {(r["prefill_ep"], r["decode_ep"]): r for r in results[:-1]}
    assert set(layouts) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert layouts[(1, 2)]["layout"] == "2:2 EP 1:2"
    assert layouts[(1, 1)]["goodput_per_gpu"] == layouts[(1, 2)]["goodput_per_gpu"] == 0.0
    best = results[-1]["best"]
    assert best["prefill_ep"] == 2 and best["goodput_per_gpu"] > 0
    document = yaml.safe_load("\n".join(lines[len(results):]))
    args = AppArgs.parse(document["applications"][0]["args"])
    assert (args.prefill.expert_parallel_size, args.prefill.tensor_parallel_size) == (2, 2)
    assert args.prefill.num_replicas == 2 and args.decode.expert_parallel_size == best["decode_ep"]
    # the engine section is shared: the KV a rank of the smallest EP size leaves
    assert args.engine.kv_cache_bytes == kv_cache_bytes(load_model_config(model_dir(MOE)), H200,
                                                        parallel=ExpertParallel(min(best["prefill_ep"],
                                                                                    best["decode_ep"])))


def test_a_cpu_run_at_ep_2_is_predicted_from_its_ep_1_profile(tmp_path):
    model = small_moe(tmp_path)
    measured = CostModel(base_s=2e-3, per_token_s=1e-4, per_pair_s=1e-8, per_seq_s=1e-4, per_sample_s=2e-5,
                         source="measured")
    shape = StepShape(num_tokens=32, attn_pairs=32 * 100, num_seqs=32, num_samples=32)
    same = predict_expert_parallel(measured, model, 1, attention_split=False, link_bytes_per_s=2e9, latency_s=1e-4)
    assert same.step_seconds(shape) == measured.step_seconds(shape)
    free = predict_expert_parallel(measured, model, 2, attention_split=False, link_bytes_per_s=1e30, latency_s=0.0)
    parts = free.parts(shape)
    share = free.expert_flop_share
    assert 0 < share < 1 and parts.experts_s == pytest.approx(share * 1e-4 * 32) and parts.dense_s == 0
    assert parts.predicted_s == pytest.approx(parts.measured_s - parts.experts_s / 2)  # experts halved per rank
    loopback = predict_expert_parallel(measured, model, 2, attention_split=False, link_bytes_per_s=2e9,
                                       latency_s=1e-4, memory_bytes_per_s=10e9, dispatch="all_to_all")
    parts = loopback.parts(shape)
    reads = loopback.reads.seconds(32)  # 2 layers of 8 experts (32 tokens touch nearly all), 12 KiB each
    assert reads == pytest.approx(2 * 8 * (1 - 0.75**32) * 2 * 3 * 64 * 32 / 10e9)
    # the all-to-all over loopback: per MoE layer the split sizes, dispatch, combine and the block's all-reduce
    a2a = 4 * 2 * 1e-4 + 32 * 2 * (all_to_all_bytes_per_token(model, 2) / 2 + all_reduce_bytes_per_token(model, 2)) / 2e9
    assert parts.collectives_s == pytest.approx(a2a)
    assert parts.predicted_s == pytest.approx(parts.measured_s - (share * 32e-4 + reads) / 2 + a2a)
    split = predict_expert_parallel(measured, model, 2, attention_split=True, link_bytes_per_s=2e9, latency_s=1e-4)
    assert split.parts(shape).dense_s > 0 and split.parts(shape).collectives_s > parts.collectives_s
