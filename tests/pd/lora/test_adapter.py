"""``pd.lora.adapter``: peft adapters read as peft computes them, every unsupported one refused by name."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd.lora.adapter import CONFIG_FILE, LORA_MODULES, WEIGHTS_FILE, load_adapter
from pd.model.config import MlaConfig, MoeConfig, load_model_config
from pd.model.loader import read_tensors
from tests.lora_adapters import hf_model_with_adapter, hf_peft_greedy, make_adapter

MAX_RANK = 16
PREFIX = "base_model.model.model.layers"
# Sorted, as peft saves them: the first pattern that matches a module's name wins, so layer 0's q_proj takes 6
# (its full name) and layer 1's takes 4; the escaped one is a real regular expression.
RANK_PATTERN = {r"layers\.1\.mlp\.down_proj": 2, "model.layers.0.self_attn.q_proj": 6, "q_proj": 4}
ALPHA_PATTERN = {"o_proj": 4, "v_proj": 32}
ADAPTERS = {
    "plain": dict(r=8, alpha=16),
    "rslora": dict(r=8, alpha=16, use_rslora=True),
    "patterned": dict(r=8, alpha=16, rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN),
}


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def model(base):
    return load_model_config(base)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Each of ``ADAPTERS`` built and saved by peft on the tiny llama checkpoint."""
    root = tmp_path_factory.mktemp("adapters")
    return {kind: make_adapter(base, root / kind, seed=i, **kwargs) for i, (kind, kwargs) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def plain(adapters):
    return adapters["plain"]


def _copy(adapter_dir: Path, to: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """The adapter at ``adapter_dir`` copied to ``to``, with its config's fields updated and its tensors replaced."""
    shutil.copytree(adapter_dir, to)
    if config is not None:
        raw = json.loads((to / CONFIG_FILE).read_text())
        (to / CONFIG_FILE).write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        save_file(tensors, str(to / WEIGHTS_FILE))
    return to


def _refused(path: Path, model, *names: str, max_rank: int = MAX_RANK) -> str:
    """Loading raises a ValueError naming the adapter, its path and each of ``names``; the message."""
    with pytest.raises(ValueError) as info:
        load_adapter("refused-one", path, model, max_rank)
    message = str(info.value)
    for name in ("'refused-one'", str(path), *names):
        assert name in message, f"{name!r} not in {message!r}"
    return message


def test_an_adapter_loads_with_its_shapes_ranks_and_scaled_b(plain, model):
    adapter = load_adapter("plain", plain, model, MAX_RANK)
    stored = load_file(str(plain / WEIGHTS_FILE))
    assert adapter.name == "plain" and adapter.path == Path(plain) and adapter.rank == 8
    assert list(adapter.modules) == [(layer, m) for layer in range(model.num_layers) for m in LORA_MODULES]
    features = {"q_proj": (128, 128), "k_proj": (128, 64), "v_proj": (128, 64), "o_proj": (128, 128),
                "gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}
    for (layer, module), weights in adapter.modules.items():
        in_features, out_features = features[module]
        assert weights.a.shape == (8, in_features) and weights.b.shape == (out_features, 8)
        assert weights.a.dtype == weights.b.dtype == torch.float32 and weights.a.device.type == "cpu"
        key = f"{PREFIX}.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
        assert torch.equal(weights.a, stored[f"{key}.lora_A.weight"])
        assert torch.allclose(weights.b, stored[f"{key}.lora_B.weight"] * 2.0)  # alpha 16 / r 8
    assert adapter.num_bytes == sum(4 * (w.a.numel() + w.b.numel()) for w in adapter.modules.values())
    with pytest.raises(TypeError):
        adapter.modules[(0, "q_proj")] = None


@pytest.mark.parametrize("kind", ADAPTERS)
def test_b_times_a_is_peft_merged_delta(kind, adapters, base, model):
    """peft's own merge (scaling, rsLoRA, rank_pattern / alpha_pattern) minus the base is B·A, module by module."""
    adapter = load_adapter(kind, adapters[kind], model, MAX_RANK)
    merged = hf_model_with_adapter(base, adapters[kind]).merge_and_unload().state_dict()
    base_weights = read_tensors(base)
    for (layer, module), weights in adapter.modules.items():
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.{layer}.{block}.{module}.weight"
        torch.testing.assert_close(merged[name] - base_weights[name], weights.b @ weights.a, atol=2e-5, rtol=1e-4)
    if kind == "rslora":
        stored = load_file(str(adapters[kind] / WEIGHTS_FILE))[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
        torch.testing.assert_close(adapter.modules[(0, "q_proj")].b, stored * 16 / math.sqrt(8))
    if kind == "patterned":
        ranks = {where: w.a.shape[0] for where, w in adapter.modules.items()}
        assert ranks[(0, "q_proj")] == 6 and ranks[(1, "q_proj")] == 4 and ranks[(1, "down_proj")] == 2
        assert ranks[(0, "down_proj")] == 8 and adapter.rank == 8


def test_the_adapter_changes_greedy_tokens(plain, base):
    """The helper's adapters move HF's greedy tokens, so a served adapter ignored cannot pass for one applied."""
    prompts = [[1, 17, 42, 99, 256, 7], [3, 300, 301, 5]]
    with_adapter = hf_peft_greedy(base, plain, prompts, 8)
    without = hf_peft_greedy(base, None, prompts, 8)
    assert all(len(tokens) == len(gaps) == 8 for tokens, gaps in with_adapter)
    assert [tokens for tokens, _ in with_adapter] != [tokens for tokens, _ in without]


def test_digest_is_the_files_identity(plain, model, tmp_path):
    first = load_adapter("plain", plain, model, MAX_RANK).digest
    assert len(first) == 32 and int(first, 16) >= 0
    assert load_adapter("plain", plain, model, MAX_RANK).digest == first
    # The config's canonical JSON: its layout is not its identity; its values are.
    reformatted = _copy(plain, tmp_path / "reformatted")
    raw = json.loads((reformatted / CONFIG_FILE).read_text())
    (reformatted / CONFIG_FILE).write_text(json.dumps(dict(reversed(raw.items())), indent=7))
    assert load_adapter("plain", reformatted, model, MAX_RANK).digest == first
    assert load_adapter("plain", _copy(plain, tmp_path / "alpha", config={"lora_alpha": 8}), model,
                        MAX_RANK).digest != first
    tensors = load_file(str(plain / WEIGHTS_FILE))
    tensors[f"{PREFIX}.1.mlp.up_proj.lora_B.weight"][0, 0] += 1e-3
    retrained = _copy(plain, tmp_path / "retrained", tensors=tensors)
    assert load_adapter("plain", retrained, model, MAX_RANK).digest != first


@pytest.mark.parametrize("changes, field", [
    ({"peft_type": "IA3"}, "peft_type"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"bias": "lora_only"}, "bias"),
    ({"lora_bias": True}, "lora_bias"),
    ({"use_qalora": True}, "use_qalora"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({"velora_config": {"num_groups": 2}}, "velora_config"),
    ({"monteclora_config": {"num_samples": 2}}, "monteclora_config"),
    ({"use_bdlora": {"nblocks": 2}}, "use_bdlora"),
    ({"arrow_config": {"top_k": 2}}, "arrow_config"),
    ({"kasa_config": {"init": "svd"}}, "kasa_config"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
    ({"init_lora_weights": "olora"}, "init_lora_weights"),
    ({"init_lora_weights": "corda"}, "init_lora_weights"),
    ({"init_lora_weights": "loftq"}, "init_lora_weights"),
    ({"init_lora_weights": "lora_ga"}, "init_lora_weights"),
    ({"a_future_variant": True}, "a_future_variant"),
    ({"r": 0}, "r"),
    ({"r": "8"}, "r"),
    ({"lora_alpha": True}, "lora_alpha"),
    ({"use_rslora": "yes"}, "use_rslora"),
    ({"rank_pattern": {"(q_proj": 4}}, "rank_pattern"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
    ({"alpha_pattern": ["q_proj"]}, "alpha_pattern"),
])
def test_config_fields_that_change_the_math_are_refused(changes, field, plain, model, tmp_path):
    _refused(_copy(plain, tmp_path / "variant", config=changes), model, CONFIG_FILE, repr(field))


@pytest.mark.parametrize("changes", [
    {"init_lora_weights": "gaussian"}, {"init_lora_weights": "mica"}, {"init_lora_weights": False},
    {"lora_dropout": 0.3}, {"layers_to_transform": [0, 1]}, {"enable_lora": None, "merge_weights": False},
    {"eva_config": {"rho": 2.0}}, {"megatron_config": None}, {"exclude_modules": ["lm_head"]},
])
def test_training_fields_are_ignored(changes, plain, model, tmp_path):
    adapter = load_adapter("plain", _copy(plain, tmp_path / "variant", config=changes), model, MAX_RANK)
    assert adapter.rank == 8 and len(adapter.modules) == 2 * len(LORA_MODULES)


def test_a_rank_above_max_rank_is_refused_naming_the_module(plain, adapters, model, tmp_path):
    _refused(plain, model, "'model.layers.0.self_attn.q_proj'", "rank 8", "max_rank 4", max_rank=4)
    _refused(adapters["patterned"], model, "'model.layers.0.self_attn.k_proj'", "rank 8", "max_rank 6", max_rank=6)
    # rank_pattern raises v_proj's rank past max_rank: refused before its tensors are looked at.
    raised = _copy(plain, tmp_path / "raised", config={"rank_pattern": {"v_proj": 32}})
    _refused(raised, model, "'model.layers.0.self_attn.v_proj'", "rank 32", f"max_rank {MAX_RANK}")


def test_a_rank_pattern_the_tensors_disagree_with_is_refused(plain, model, tmp_path):
    wrong = _copy(plain, tmp_path / "wrong", config={"rank_pattern": {"v_proj": 4}})
    _refused(wrong, model, f"{PREFIX}.0.self_attn.v_proj.lora_A.weight", "(8, 128)", "(4, 128)")


def test_missing_or_unsafe_files_are_refused(plain, model, tmp_path):
    _refused(tmp_path / "nowhere", model, "no such directory")
    _refused(plain / CONFIG_FILE, model, "not a directory")
    pickled = _copy(plain, tmp_path / "pickled")
    (pickled / WEIGHTS_FILE).unlink()
    (pickled / "adapter_model.bin").write_bytes(b"never unpickled")
    _refused(pickled, model, "adapter_model.bin", "safetensors is needed")
    no_weights = _copy(plain, tmp_path / "no_weights")
    (no_weights / WEIGHTS_FILE).unlink()
    _refused(no_weights, model, WEIGHTS_FILE, "missing")
    not_json = _copy(plain, tmp_path / "not_json")
    (not_json / CONFIG_FILE).write_text("{r: 8")
    _refused(not_json, model, CONFIG_FILE, "not valid JSON")
    a_list = _copy(plain, tmp_path / "a_list")
    (a_list / CONFIG_FILE).write_text("[]")
    _refused(a_list, model, CONFIG_FILE, "JSON object")
    truncated = _copy(plain, tmp_path / "truncated")
    (truncated / WEIGHTS_FILE).write_bytes((plain / WEIGHTS_FILE).read_bytes()[:1000])
    _refused(truncated, model, WEIGHTS_FILE, "corrupt or truncated")


def test_a_missing_config_is_refused(plain, model, tmp_path):
    no_config = _copy(plain, tmp_path / "no_config")
    (no_config / CONFIG_FILE).unlink()
    _refused(no_config, model, CONFIG_FILE, "missing")


EXTRA = torch.zeros(8, 128)


@pytest.mark.parametrize("key, words", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", ("embeddings or lm_head",)),
    ("base_model.model.lm_head.lora_A.weight", ("embeddings or lm_head",)),
    (f"{PREFIX}.0.mlp.experts.0.gate_proj.lora_A.weight", ("MoE experts",)),
    (f"{PREFIX}.0.mlp.experts.lora_A.weight", ("MoE experts",)),
    (f"{PREFIX}.0.mlp.shared_expert.up_proj.lora_A.weight", ("MoE experts",)),
    (f"{PREFIX}.0.mlp.shared_experts.up_proj.lora_A.weight", ("MoE experts",)),
    (f"{PREFIX}.0.mlp.gate.lora_A.weight", ("MoE experts",)),
    (f"{PREFIX}.0.block_sparse_moe.w1.lora_A.weight", ("MoE experts",)),
    (f"{PREFIX}.0.self_attn.q_a_proj.lora_A.weight", ("multi-head latent attention",)),
    (f"{PREFIX}.0.self_attn.kv_a_proj_with_mqa.lora_A.weight", ("multi-head latent attention",)),
    (f"{PREFIX}.0.self_attn.rotary_emb.lora_A.weight", ("'self_attn.rotary_emb'", "not one LoRA may target")),
    (f"{PREFIX}.0.mlp.fc1.lora_A.weight", ("'mlp.fc1'", "not one LoRA may target")),
    (f"{PREFIX}.0.self_attn.q_proj.lora_A.default.weight", ("not a LoRA weight",)),
    (f"{PREFIX}.0.self_attn.q_proj.lora_B.bias", ("not a LoRA weight",)),
    (f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", ("not a LoRA weight",)),
    (f"{PREFIX}.2.self_attn.q_proj.lora_A.weight", ("layer 2 is out of range", "2 layers")),
    ("model.layers.0.self_attn.q_proj.lora_A.weight", ("both lora_A", "'model.layers.0.self_attn.q_proj'")),
])
def test_tensors_outside_the_dense_projections_are_refused(key, words, plain, model, tmp_path):
    tensors = {**load_file(str(plain / WEIGHTS_FILE)), key: EXTRA}
    _refused(_copy(plain, tmp_path / "extra", tensors=tensors), model, repr(key), *words)


def test_tensors_that_do_not_fit_the_base_model_are_refused(plain, model, tmp_path):
    stored = load_file(str(plain / WEIGHTS_FILE))
    q_a, q_b = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
    cases = [
        ({k: v for k, v in stored.items() if k != q_b}, ("'model.layers.0.self_attn.q_proj'", "no lora_B")),
        ({k: v for k, v in stored.items() if k != q_a}, ("'model.layers.0.self_attn.q_proj'", "no lora_A")),
        ({**stored, q_a: stored[q_a][:, :64].contiguous()}, (repr(q_a), "(8, 64)", "(8, 128)")),
        ({**stored, q_b: stored[q_b][:, :4].contiguous()}, (repr(q_b), "(128, 4)", "(128, 8)")),
        ({**stored, q_a: stored[q_a].to(torch.int32)}, (repr(q_a), "floating point")),
        ({**stored, q_b: torch.full_like(stored[q_b], float("nan"))}, (repr(q_b), "NaN")),
        ({}, (WEIGHTS_FILE, "no LoRA weights")),
    ]
    for i, (tensors, words) in enumerate(cases):
        _refused(_copy(plain, tmp_path / f"case{i}", tensors=tensors), model, *words)


def test_half_precision_weights_load_as_fp32(plain, model, tmp_path):
    stored = load_file(str(plain / WEIGHTS_FILE))
    halved = _copy(plain, tmp_path / "bf16", tensors={k: v.to(torch.bfloat16) for k, v in stored.items()})
    adapter = load_adapter("bf16", halved, model, MAX_RANK)
    weights = adapter.modules[(1, "down_proj")]
    assert weights.a.dtype == weights.b.dtype == torch.float32
    torch.testing.assert_close(weights.a, stored[f"{PREFIX}.1.mlp.down_proj.lora_A.weight"], atol=1e-2, rtol=1e-2)


def test_an_moe_layers_mlp_is_refused_and_its_attention_kept(plain, model, tmp_path):
    moe = dataclasses.replace(model, moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=32, renormalize=True,
                                                   layers=(False, True)))
    _refused(plain, moe, f"{PREFIX}.1.mlp.down_proj.lora_A.weight", "layer 1's MLP is a mixture of experts")
    dense_only = {k: v for k, v in load_file(str(plain / WEIGHTS_FILE)).items() if ".1.mlp." not in k}
    adapter = load_adapter("dense", _copy(plain, tmp_path / "dense", tensors=dense_only), moe, MAX_RANK)
    assert (0, "down_proj") in adapter.modules and (1, "q_proj") in adapter.modules
    assert (1, "down_proj") not in adapter.modules


def test_attention_of_an_mla_model_is_refused(plain, model, tmp_path):
    mla = dataclasses.replace(model, architecture="DeepseekV3ForCausalLM", num_kv_heads=1, head_dim=8,
                              mla=MlaConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                                            qk_rope_head_dim=8, v_head_dim=16))
    _refused(plain, mla, f"{PREFIX}.0.self_attn.k_proj.lora_A.weight", "multi-head latent attention")
    mlp_only = {k: v for k, v in load_file(str(plain / WEIGHTS_FILE)).items() if ".mlp." in k}
    adapter = load_adapter("mlp", _copy(plain, tmp_path / "mlp", tensors=mlp_only), mla, MAX_RANK)
    assert sorted({module for _, module in adapter.modules}) == ["down_proj", "gate_proj", "up_proj"]


def test_peft_adapters_on_a_deepseek_model_are_refused(checkpoint, tmp_path):
    """What peft itself writes for DeepSeek: LoRA on MLA's o_proj; on the MLP, peft targets the fused experts."""
    base = checkpoint("deepseek_v3")
    model = load_model_config(base)
    attention = make_adapter(base, tmp_path / "attention", r=4, alpha=8, target_modules=("o_proj",))
    _refused(attention, model, "self_attn.o_proj.lora_A.weight", "multi-head latent attention")
    experts = make_adapter(base, tmp_path / "experts", r=4, alpha=8, target_modules=("gate_proj", "up_proj"))
    _refused(experts, model, "'target_parameters'", "MoE experts")


def test_load_adapter_arguments(plain, model):
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        load_adapter("", plain, model, MAX_RANK)
    _refused(plain, model, "max_rank must be an integer >= 1", max_rank=0)
