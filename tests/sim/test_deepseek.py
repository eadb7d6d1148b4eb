"""DeepSeek-V3 and V2-Lite in the simulator: their presets, multi-head latent attention's KV and step price,
block-FP8 weights, and the planner on a node of eight H200s."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import yaml

from pd.config.app import AppArgs
from pd.model.config import model_config_from_dict
from pd.model.quant_scheme import WeightFormat
from sim.cost import StepShape
from sim.expert_parallel import ExpertParallel
from sim.hardware import (
    HARDWARE,
    MODELS,
    analytic_cost,
    expert_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    num_active_params,
    num_params,
    rank_weight_bytes,
    weight_bytes,
)
from sim.params import decode_pair_bytes, decode_pair_flops, prefill_pair_flops, weight_parts
from sim.plan import main

H200 = HARDWARE["h200"]
V3, LITE = model_config_from_dict(MODELS["deepseek-v3"]), model_config_from_dict(MODELS["deepseek-v2-lite"])


def test_the_presets_parse_as_the_released_checkpoints():
    assert V3.architecture == "DeepseekV3ForCausalLM" and (V3.num_layers, V3.hidden_size, V3.num_heads) == (61, 7168, 128)
    assert V3.mla is not None and V3.num_kv_heads == 1 and V3.kv_planes == 1 and V3.kv_head_dim == 576
    assert (V3.mla.q_lora_rank, V3.mla.kv_lora_rank, V3.mla.qk_nope_head_dim, V3.mla.qk_rope_head_dim,
            V3.mla.v_head_dim) == (1536, 512, 128, 64, 128)
    moe = V3.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (256, 8, 2048, 2048)
    assert moe.layers == (False,) * 3 + (True,) * 58 and not moe.shared_expert_gated
    assert (moe.topk_method, moe.num_groups, moe.topk_group, moe.routed_scaling_factor) == ("noaux_tc", 8, 4, 2.5)
    assert (V3.rope.rope_type, V3.rope.factor, V3.rope.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert (V3.rope.mscale, V3.rope.mscale_all_dim, V3.max_position_embeddings) == (1.0, 1.0, 163840)
    assert V3.quantization is not None and V3.quantization.format is WeightFormat.FP8_BLOCK
    assert (V3.vocab_size, V3.intermediate_size) == (129280, 18432)

    assert LITE.architecture == "DeepseekV2ForCausalLM" and (LITE.num_layers, LITE.hidden_size) == (27, 2048)
    assert LITE.mla.q_lora_rank is None and LITE.kv_head_dim == 576 and LITE.quantization is None
    moe = LITE.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (64, 6, 1408, 2816)
    assert moe.layers == (False,) + (True,) * 26 and moe.topk_method == "greedy"
    assert (LITE.vocab_size, LITE.intermediate_size) == (102400, 10944)


def test_mla_keeps_one_latent_row_a_token_and_layer():
    assert kv_bytes_per_token(V3) == 576 * 2 * 61 == 70_272  # bf16
    assert kv_bytes_per_token(V3, dtype_bytes=1) == 35_136  # an FP8 pool
    assert kv_bytes_per_token(LITE) == 576 * 2 * 27
    # grouped-query attention keeps K and V of every KV head, as before
    llama = model_config_from_dict(MODELS["llama-3-8b"])
    assert kv_bytes_per_token(llama) == 32 * 2 * 8 * 128 * 2


def test_the_presets_have_the_papers_total_and_active_parameters():
    # The papers count the LM head among the active parameters but not the input embeddings (a lookup).
    for model, total, active in ((V3, 671e9, 37e9), (LITE, 15.7e9, 2.4e9)):
        embeddings = weight_parts(model).embeddings
        assert num_params(model) + embeddings == pytest.approx(total, rel=0.01)
        assert num_active_params(model) + embeddings / 2 == pytest.approx(active, rel=0.03)
    parts = weight_parts(V3)
    # per layer: q_a 7168 x 1536 and kv_a_proj_with_mqa 7168 x 576 whole on every rank; q_b, kv_b and o split
    assert parts.attention_replicated == 61 * 7168 * (1536 + 576)
    assert parts.attention == 61 * (1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168)
    assert parts.dense_mlp == 3 * 3 * 7168 * 18432 and parts.shared_experts == 58 * 3 * 7168 * 2048
    assert parts.routed_active == 58 * 8 * 3 * 7168 * 2048


def test_block_fp8_weights_are_a_byte_each_and_need_eight_h200s():
    parts = weight_parts(V3)
    assert weight_bytes(V3) == parts.linear + 2 * (parts.routers + parts.embeddings)
    assert weight_bytes(V3) == pytest.approx(673e9, rel=0.01)
    assert expert_bytes(V3) == parts.routed_experts
    assert weight_bytes(LITE) == 2 * (num_params(LITE) + weight_parts(LITE).embeddings)  # bf16
    # 256 experts and 128 heads split over powers of two: EP 4 leaves 171 GB a rank, EP 8 87 GB
    with pytest.raises(ValueError, match="do not fit"):
        kv_cache_bytes(V3, H200, parallel=ExpertParallel(4))
    assert rank_weight_bytes(V3, ExpertParallel(8)) == pytest.approx(87.4e9, rel=0.01)
    per_rank = kv_cache_bytes(V3, H200, parallel=ExpertParallel(8))
    assert per_rank // kv_bytes_per_token(V3) == pytest.approx(687_000, rel=0.01)  # tokens a replica holds


def test_prompts_attend_decompressed_and_decodes_absorbed():
    one = analytic_cost(V3, H200)
    attention = H200.bf16_flops * 0.3
    assert prefill_pair_flops(V3) == 2 * 61 * 128 * (192 + 128)
    assert one.per_pair_s == pytest.approx(prefill_pair_flops(V3) / attention)
    assert decode_pair_flops(V3) == 2 * 61 * 128 * (576 + 512) and decode_pair_bytes(V3) == 70_272
    assert one.decode_pair_s == pytest.approx(decode_pair_flops(V3) / attention + 70_272 / (H200.hbm_bytes_per_s * 0.8))
    # the linear layers compute at the FP8 rate and each expert reads a byte a weight
    assert one.per_token_s == pytest.approx(2 * num_active_params(V3) / (H200.fp8_flops * 0.5))
    assert one.experts.per_expert_s == pytest.approx(3 * 7168 * 2048 / (H200.hbm_bytes_per_s * 0.8))
    # a decode step's pairs take the decode price, any step with a prompt's chunk the prompt's
    decodes = StepShape(num_tokens=64, attn_pairs=64 * 4096, num_seqs=64, num_samples=64)
    mixed = StepShape(num_tokens=64 + 512, attn_pairs=64 * 4096, num_seqs=65, num_samples=65)
    assert one.pair_seconds(decodes) == one.decode_pair_s and one.pair_seconds(mixed) == one.per_pair_s
    # over eight ranks the heads' FLOPs split, but every rank reads the whole latent
    eight = analytic_cost(V3, H200, parallel=ExpertParallel(8))
    assert eight.per_pair_s == pytest.approx(one.per_pair_s / 8)
    assert eight.decode_pair_s == pytest.approx(decode_pair_flops(V3) / attention / 8
                                                + 70_272 / (H200.hbm_bytes_per_s * 0.8))
    # a dense GQA model has no decode price of its own
    assert analytic_cost(model_config_from_dict(MODELS["llama-3-8b"]), H200).decode_pair_s is None


def _plan(argv: list[str]) -> tuple[list[dict], dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--model", "deepseek-v3", "--hardware", "h200", "--workload", "mooncake", "--seconds", "3",
              "--bisection-steps", "0", *argv])
    lines = out.getvalue().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return records, yaml.safe_load("\n".join(lines[len(records):]))


def test_the_planner_splits_a_node_of_eight_h200s_for_deepseek_v3():
    # EP 1, 2 and 4 leave a rank more weights than an H200 holds: the node is one EP 8 replica, colocated
    records, document = _plan(["--gpus", "8", "--unit-gpus", "8", "--prefill-ep", "1,2,4,8", "--decode-ep", "1,2,4,8"])
    assert [r["expert_parallel_size"] for r in records if "refused" in r] == [1, 2, 4]
    best = records[-1]
    assert best["refused_expert_parallel_sizes"] == [1, 2, 4]
    assert best["best"]["layout"] == "colocated:8 EP 8" and best["best"]["goodput_per_gpu"] > 0
    args = AppArgs.parse(document["applications"][0]["args"])
    assert args.decode.num_replicas == 1 and args.decode.expert_parallel_size == args.decode.tensor_parallel_size == 8
    # two nodes split 8:8, each pool one EP 8 replica
    records, document = _plan(["--gpus", "16", "--unit-gpus", "16", "--splits", "8", "--prefill-ep", "8",
                               "--decode-ep", "8"])
    assert records[-1]["best"]["layout"] == "8:8 EP 8:8" and records[-1]["best"]["goodput_per_gpu"] > 0
    args = AppArgs.parse(document["applications"][0]["args"])
    assert (args.prefill.num_replicas, args.prefill.expert_parallel_size) == (1, 8)
    assert (args.decode.num_replicas, args.decode.expert_parallel_size) == (1, 8)
    assert args.engine.kv_cache_bytes == kv_cache_bytes(V3, H200, parallel=ExpertParallel(8))
