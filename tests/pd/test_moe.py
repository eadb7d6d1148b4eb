"""Mixture-of-experts models: Qwen3-MoE, Mixtral and Qwen2-MoE equal HF, loaded from either expert layout."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

import pd_kernels
from pd import LLM, SamplingParams
from pd.model import moe as moe_module
from pd.model.attention import AttentionMetadata
from pd.model.config import model_config_from_dict
from pd.model.loader import load_weights, read_tensors
from pd.model.tp import TPShard, check_tp
from tests.checkpoints import MOE_KINDS
from tests.reference import assert_greedy_match, greedy_references, hf_greedy

PROMPT_LENS = (3, 29, 70, 131)
MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
CPU = torch.device("cpu")


def prompts(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


BASE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "moe_intermediate_size": 8,
        "num_experts_per_tok": 2}


def test_config_names_layers_and_routing():
    """Both names for the expert count; MoE layers per ``mlp_only_layers`` and ``decoder_sparse_step``;
    renormalisation per architecture."""
    moe = model_config_from_dict({**BASE, "num_local_experts": 4, "mlp_only_layers": [2]}).moe
    assert (moe.num_experts, moe.layers, moe.renormalize) == (4, (True, True, False, True), False)
    moe = model_config_from_dict({**BASE, "num_experts": 6, "decoder_sparse_step": 2, "norm_topk_prob": True}).moe
    assert (moe.num_experts, moe.layers, moe.renormalize) == (6, (False, True, False, True), True)
    assert model_config_from_dict({**BASE, "num_experts": 0}).moe is None  # HF: dense layers throughout
    mixtral = model_config_from_dict({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                                      "norm_topk_prob": False})
    assert (mixtral.moe.renormalize, mixtral.moe.intermediate_size, mixtral.moe.layers) == (True, 24, (True,) * 4)
    qwen2 = model_config_from_dict({**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
                                    "shared_expert_intermediate_size": 12})
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.moe.shared_expert_intermediate_size) == (True, False, 12)
    assert model_config_from_dict({**BASE, "num_experts": 4}).qk_norm


@pytest.mark.parametrize("change, message", [
    ({"num_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok 3 exceeds its num_experts 2"),
    ({"num_local_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok must be >= 1"),
    ({"num_local_experts": 4, "moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"num_local_experts": 4, "decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
])
def test_bad_moe_configs_are_named(change, message):
    raw = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        model_config_from_dict(raw)


def test_tensor_parallel_splits_the_experts_intermediate_features():
    config = model_config_from_dict({**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
                                     "shared_expert_intermediate_size": 12})
    local = TPShard(1, 2).local_config(config)
    assert (local.moe.intermediate_size, local.moe.shared_expert_intermediate_size, local.moe.num_experts) == (4, 6, 4)
    four_heads = dataclasses.replace(config, num_heads=4)
    with pytest.raises(ValueError, match="expert intermediate size 6"):
        check_tp(dataclasses.replace(four_heads, moe=dataclasses.replace(config.moe, intermediate_size=6)), 4)
    with pytest.raises(ValueError, match="shared expert intermediate size 10"):
        check_tp(dataclasses.replace(four_heads, moe=dataclasses.replace(config.moe,
                                                                        shared_expert_intermediate_size=10)), 4)


@pytest.fixture(scope="module")
def references(checkpoint, hf_model):
    return greedy_references(checkpoint, hf_model, prompts(), MAX_NEW)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_greedy_batched_matches_hf(kind, checkpoint, references):
    """Batched and chunked (steps mix prefill and decode), so the router and experts see mixed batches."""
    llm = LLM(str(checkpoint(kind)), num_blocks=128, max_num_batched_tokens=64)
    outputs = llm.generate(prompts(), GREEDY)
    for out, (ref_tokens, gaps) in zip(outputs, references(kind)):
        assert out.finish_reason == "length"
        assert_greedy_match(out.token_ids, ref_tokens, gaps)


def _forward(llm, tokens):
    """Our logits at every position of ``tokens``, in one pass through the paged cache."""
    runner = llm.engine.runner
    attn = AttentionMetadata(
        slot_mapping=torch.arange(len(tokens)), cu_seqlens_q=torch.tensor([0, len(tokens)], dtype=torch.int32),
        seq_lens=torch.tensor([len(tokens)], dtype=torch.int32),
        block_table=torch.tensor([list(range(-(-len(tokens) // 16)))], dtype=torch.int32), backend="cpu")
    with torch.inference_mode():
        return runner.model.forward(torch.tensor(tokens), torch.arange(len(tokens)), attn, runner.kv_views,
                                    torch.arange(len(tokens)))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_logits_and_chosen_experts_match_hf_layer_by_layer(kind, checkpoint, hf_model, monkeypatch):
    """On one prompt: every MoE layer routes each token to HF's experts, and the logits agree."""
    path = checkpoint(kind)
    model = hf_model(path)
    tokens = prompts(seed=5)[3]
    theirs = []
    routers = [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "block_sparse_moe.gate"))]
    hooks = [r.register_forward_hook(lambda _m, _i, out: theirs.append(out[2].reshape(-1, out[2].shape[-1])))
             for r in routers]
    try:
        with torch.no_grad():
            expected = model(torch.tensor([tokens])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    ours = []
    select = pd_kernels.select_experts

    def recording(logits, top_k, renormalize, **routing):
        weights, ids = select(logits, top_k, renormalize, **routing)
        ours.append(ids)
        return weights, ids

    llm = LLM(str(path), num_blocks=16, block_size=16)
    monkeypatch.setattr(moe_module.pd_kernels, "select_experts", recording)
    got = _forward(llm, tokens)
    monkeypatch.undo()
    assert len(ours) == len(theirs) == llm.engine.runner.model_config.moe.num_moe_layers
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values), f"MoE layer {layer} routes differently"
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def _stacked_copy(path, tmp_path):
    """The checkpoint with each layer's experts stacked on disk (``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``), as recent transformers holds them."""
    tensors = read_tensors(path)
    config = json.loads((path / "config.json").read_text())
    out = {}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        gates = sorted((n for n in tensors if n.startswith(p) and n.endswith("gate_proj.weight")),
                       key=lambda n: int(n[len(p):].split(".")[0]))
        if not gates:
            continue
        ups = [tensors.pop(n.replace("gate_proj", "up_proj")) for n in gates]
        downs = [tensors.pop(n.replace("gate_proj", "down_proj")) for n in gates]
        out[p + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(g), u]) for g, u in zip(gates, ups)])
        out[p + "down_proj"] = torch.stack(downs)
    tmp_path.mkdir()
    save_file({**tensors, **out}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("shard", [TPShard(0, 1), TPShard(1, 2)])
def test_both_expert_layouts_load_into_the_fused_weights(shard, checkpoint, tmp_path):
    """Per-expert tensors and stacked ones give the same fused weights: each expert's gate rows, then its up
    rows, of the rank's slice of the intermediate features; and the rank's down columns."""
    path = checkpoint("qwen3_moe")
    stacked = _stacked_copy(path, tmp_path / "stacked")
    config = model_config_from_dict(json.loads((path / "config.json").read_text()))
    full = read_tensors(path)
    per_expert = load_weights(path, config, torch.float32, CPU, shard)
    fused = load_weights(stacked, config, torch.float32, CPU, shard)
    inter = config.moe.intermediate_size
    start, stop = (0, inter) if shard.size == 1 else shard.expert_intermediate(config)
    for layer in (1, 2):
        a, b = per_expert.layers[layer].moe, fused.layers[layer].moe
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
        p = f"model.layers.{layer}.mlp.experts.5."
        assert torch.equal(a.w13[5], torch.cat([full[p + "gate_proj.weight"][start:stop],
                                                full[p + "up_proj.weight"][start:stop]]))
        assert torch.equal(a.w2[5], full[p + "down_proj.weight"][:, start:stop])
    assert per_expert.layers[0].moe is None and per_expert.layers[0].gate_up_proj is not None  # mlp_only_layers
    assert per_expert.num_bytes == fused.num_bytes


def test_a_missing_or_misshapen_expert_is_named(checkpoint, tmp_path):
    path = checkpoint("mixtral")
    tensors = read_tensors(path)
    config_text = (path / "config.json").read_text()
    config = model_config_from_dict(json.loads(config_text))
    for name, change in [("model.layers.1.block_sparse_moe.experts.3.w3.weight", None),
                         ("model.layers.2.block_sparse_moe.experts.0.w2.weight", torch.zeros(64, 47))]:
        broken = tmp_path / name.replace(".", "_")
        broken.mkdir()
        save_file({n: (change if n == name else t) for n, t in tensors.items() if n != name or change is not None},
                  str(broken / "model.safetensors"))
        (broken / "config.json").write_text(config_text)
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            load_weights(broken, config, torch.float32, CPU)


@pytest.mark.integration  # a worker process per rank
def test_two_ranks_match_the_reference(checkpoint, hf_model):
    """TP=2 equals HF (and so TP=1) on Qwen2-MoE: experts and the shared expert split, the router and the
    shared expert's gate replicated, a dense layer between; chunked so steps mix."""
    path = checkpoint("qwen2_moe")
    model = hf_model(path)
    with LLM(str(path), num_blocks=64, tensor_parallel_size=2, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts()[:3], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for out, prompt in zip(outputs, prompts()[:3]):
        assert_greedy_match(out.token_ids, *hf_greedy(model, prompt, 16))
