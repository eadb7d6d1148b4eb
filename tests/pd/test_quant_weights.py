"""8-bit checkpoints: their schemes read or refused, quantize -> load, the INT8 GEMM and FP8 dequantization."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import pd_kernels.cpu
from bench.quant_accuracy import position_logits
from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.model.linear import Linear
from pd.model.loader import Checkpoint, read_tensors
from pd.model.quant_linear import Int8Linear
from pd.model.quant_scheme import QuantScheme, WeightFormat, parse_quantization_config, quantization_config
from pd.model.quant_weights import FP8, dequantize, fuse, quantize, read_quantized
from pd.model.quantize import SCHEMES, quantize_checkpoint, quantize_tensors
from pd_kernels.int8 import int8_linear, int8_linear_reference

# As llm-compressor writes FP8_DYNAMIC (a hub checkpoint's config.json, its fields as serialised).
HUB_FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "global_compression_ratio": None, "kv_cache_scheme": None, "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                    "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
                              "observer": None, "observer_kwargs": {}}}},
}
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _with(raw: dict, path: str, value) -> dict:
    """``raw`` with the dotted ``path`` set to ``value`` (``config_groups.group_0.weights.num_bits``)."""
    out = copy.deepcopy(raw)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[last] = value
    return out


W = "config_groups.group_0.weights."
A = "config_groups.group_0.input_activations."


def test_each_scheme_parses_as_hub_checkpoints_write_it():
    fp8 = parse_quantization_config(HUB_FP8_DYNAMIC)
    assert fp8 == QuantScheme(WeightFormat.FP8_CHANNEL, "weight_scale", ("lm_head",), ("Linear",))
    int8 = _with(_with(_with(HUB_FP8_DYNAMIC, W + "type", "int"), A + "type", "int"), "format", "int-quantized")
    assert parse_quantization_config(int8).format is WeightFormat.INT8_CHANNEL
    tensor = _with(HUB_FP8_DYNAMIC, W + "strategy", "tensor")  # one scale, read as every channel's
    assert parse_quantization_config(tensor).format is WeightFormat.FP8_CHANNEL
    block = parse_quantization_config(DEEPSEEK_FP8)
    assert block.format is WeightFormat.FP8_BLOCK and block.scale_name == "weight_scale_inv" and block.ignore == ()
    ct_block = _with(_with(_with(HUB_FP8_DYNAMIC, W + "strategy", "block"), W + "block_structure", [128, 128]),
                     A + "strategy", "group")
    ct_block = _with(ct_block, A + "group_size", 128)
    assert parse_quantization_config(ct_block) == QuantScheme(WeightFormat.FP8_BLOCK, "weight_scale", ("lm_head",))
    for weight_format in WeightFormat:  # what pd.model.quantize writes reads back as itself
        scheme = parse_quantization_config(quantization_config(weight_format))
        assert scheme.format is weight_format and scheme.ignore == ("lm_head",)
    assert parse_quantization_config(None) is None
    fp8_kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    assert parse_quantization_config(_with(HUB_FP8_DYNAMIC, "kv_cache_scheme", fp8_kv)) == fp8


def test_ignore_and_targets_match_modules_as_compressed_tensors_does():
    scheme = QuantScheme(WeightFormat.INT8_CHANNEL, "weight_scale",
                         ("lm_head", r"re:.*mlp\.gate$", "layers.1.mlp.down_proj"), ("Linear",))
    assert scheme.quantizes("model.layers.0.self_attn.q_proj")
    assert not scheme.quantizes("lm_head")
    assert not scheme.quantizes("model.layers.3.mlp.gate") and scheme.quantizes("model.layers.3.mlp.gate_proj")
    assert not scheme.quantizes("model.layers.1.mlp.down_proj") and scheme.quantizes("model.layers.11.mlp.down_proj")
    only_attention = QuantScheme(WeightFormat.INT8_CHANNEL, "weight_scale", (), (r"re:.*self_attn\..*",))
    assert only_attention.quantizes("model.layers.0.self_attn.o_proj")
    assert not only_attention.quantizes("model.layers.0.mlp.up_proj")


REFUSALS = [
    (_with(HUB_FP8_DYNAMIC, W + "num_bits", 4), r"weights\.num_bits 4"),
    (_with(HUB_FP8_DYNAMIC, W + "symmetric", False), r"weights\.symmetric"),
    (_with(HUB_FP8_DYNAMIC, A + "symmetric", False), r"input_activations\.symmetric"),
    (_with(HUB_FP8_DYNAMIC, A + "dynamic", False), r"input_activations\.dynamic.*static"),
    (_with(_with(HUB_FP8_DYNAMIC, W + "strategy", "group"), W + "group_size", 128), r"weights\.strategy 'group'"),
    (_with(HUB_FP8_DYNAMIC, A + "strategy", "tensor"), r"input_activations\.strategy 'tensor'"),
    (_with(HUB_FP8_DYNAMIC, A + "type", "int"), r"input_activations\.type 'int'"),
    (_with(HUB_FP8_DYNAMIC, "config_groups.group_0.input_activations", None), r"input_activations.*W8A16"),
    (_with(HUB_FP8_DYNAMIC, "format", "pack-quantized"), r"format 'pack-quantized'"),
    (_with(HUB_FP8_DYNAMIC, "kv_cache_scheme", {"num_bits": 4, "type": "int"}), r"kv_cache_scheme"),
    (_with(HUB_FP8_DYNAMIC, "config_groups.group_1", {}), r"config_groups"),
    (_with(HUB_FP8_DYNAMIC, "quant_method", "awq"), r"quant_method 'awq'"),
    (_with(HUB_FP8_DYNAMIC, "config_groups.group_0.targets", ["Embedding"]), r"targets entry 'Embedding'"),
    (_with(DEEPSEEK_FP8, "weight_block_size", [64, 64]), r"weight_block_size \[64, 64\]"),
    (_with(DEEPSEEK_FP8, "activation_scheme", "static"), r"activation_scheme 'static'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"weight_block_size is missing"),
]


@pytest.mark.parametrize("raw, message", REFUSALS, ids=[m for _, m in REFUSALS])
def test_an_unsupported_scheme_is_refused_naming_its_field(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(raw)


@pytest.mark.parametrize("weight_format", list(WeightFormat))
def test_dequantized_weights_are_within_the_format_s_rounding(weight_format):
    torch.manual_seed(0)
    weight = torch.randn(200, 300) * 0.05
    q = quantize(weight, weight_format)
    assert q.weight.dtype == (torch.int8 if weight_format is WeightFormat.INT8_CHANNEL else FP8)
    error = (dequantize(q) - weight).abs()
    if weight_format is WeightFormat.INT8_CHANNEL:  # half a step of absmax / 127 per row
        assert torch.all(error <= weight.abs().amax(1, keepdim=True) / 127 / 2 * (1 + 1e-5))
    else:  # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value (or of the smallest normal)
        scale = q.scale[:, None] if weight_format is WeightFormat.FP8_CHANNEL else None
        floor = (scale if scale is not None else q.scale.max()) * 2.0**-6
        assert torch.all(error <= torch.maximum(weight.abs() * 2.0**-4, floor) * (1 + 1e-5))
    if weight_format is WeightFormat.FP8_BLOCK:
        assert q.scale.shape == (2, 3)  # ceil(200 / 128), ceil(300 / 128)
        assert torch.allclose(q.scale[1, 2], weight[128:, 256:].abs().max() / 448)


@pytest.mark.parametrize("num_rows", [1, 7, 17, 64, 130])
def test_int8_gemm_equals_its_float_reference(num_rows):
    torch.manual_seed(num_rows)
    x, weight, bias = torch.randn(num_rows, 200), torch.randn(72, 200) * 0.05, torch.randn(72)
    q = quantize(weight, WeightFormat.INT8_CHANNEL)
    got = int8_linear(x, q.weight, q.scale, bias)
    torch.testing.assert_close(got, int8_linear_reference(x, q.weight, q.scale, bias), atol=1e-5, rtol=1e-5)
    exact = x @ weight.t() + bias
    assert (got - exact).norm() / (exact - bias).norm() < 0.02
    assert int8_linear(x.bfloat16(), q.weight, q.scale).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight: expected a 2-D int8"):
        int8_linear(x, weight, q.scale)
    with pytest.raises(ValueError, match="weight_scale: expected fp32"):
        int8_linear(x, q.weight, q.scale[:-1])


def test_the_cpu_backend_s_loops_around_the_gemm_compute_the_aten_chain_s_numbers():
    """``cpu/int8.cpp``'s quantization and scaling equal ``pd_kernels.int8``'s aten ops (exactly, but for the bias
    add, which the compiler may fuse into one rounding), and a row holding a NaN or an infinity poisons its own
    outputs only (one request's fault stays that request's)."""
    fused = pd_kernels.cpu.build()
    torch.manual_seed(0)
    x, weight, bias = torch.randn(37, 200), torch.randn(72, 200) * 0.05, torch.randn(72)
    q = quantize(weight, WeightFormat.INT8_CHANNEL)
    assert torch.equal(int8_linear(x, q.weight, q.scale, None, fused), int8_linear(x, q.weight, q.scale))
    torch.testing.assert_close(int8_linear(x, q.weight, q.scale, bias, fused), int8_linear(x, q.weight, q.scale, bias),
                               atol=1e-6, rtol=1e-6)
    x[5, 3], x[9, 0] = float("nan"), float("inf")
    got = int8_linear(x, q.weight, q.scale, bias, fused)
    assert not got[[5, 9]].isfinite().any()
    healthy = torch.ones(37, dtype=torch.bool)
    healthy[[5, 9]] = False
    torch.testing.assert_close(got[healthy], int8_linear(x[healthy], q.weight, q.scale, bias), atol=1e-6, rtol=1e-6)


def _relative(got: torch.Tensor, exact: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (got - exact).norm() / exact.norm()
    return ((got - exact).norm(dim=dim) / exact.norm(dim=dim)).max()


def test_outlier_channels_and_tokens_keep_the_layer_s_error_bounded():
    """Weights with a few input channels x50, output channels x50, and tokens x50: per-channel weight scales
    and per-token activation scales keep every channel's and token's error small, where one scale for the
    whole tensor (the contrast, so this test can fail) loses the ordinary ones."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(32, 256, generator=g), torch.randn(192, 256, generator=g) * 0.05
    columns = weight.clone()
    columns[:, [3, 77, 150]] *= 50
    for weight_format in WeightFormat:
        q = quantize(columns, weight_format)
        got = int8_linear(x, q.weight, q.scale) if q.weight.dtype == torch.int8 else x @ dequantize(q).t()
        assert _relative(got, x @ columns.t()) < 0.05
    rows = weight.clone()
    rows[[5, 9]] *= 50
    q = quantize(rows, WeightFormat.INT8_CHANNEL)
    assert _relative(int8_linear(x, q.weight, q.scale), x @ rows.t(), dim=0) < 0.03
    step = rows.abs().max() / 127
    assert _relative(x @ ((rows / step).round() * step).t(), x @ rows.t(), dim=0) > 0.3
    tokens = x.clone()
    tokens[[2, 20]] *= 50
    q = quantize(weight, WeightFormat.INT8_CHANNEL)
    assert _relative(int8_linear(tokens, q.weight, q.scale), tokens @ weight.t(), dim=1) < 0.03
    step = tokens.abs().max() / 127
    assert _relative(((tokens / step).round() * step) @ dequantize(q).t(), tokens @ weight.t(), dim=1) > 0.3


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    """``quantized(scheme)``: the ``llama`` test checkpoint quantized by ``pd.model.quantize``, cached."""
    made = {}

    def get(scheme: str):
        if scheme not in made:
            made[scheme] = tmp_path_factory.mktemp(scheme)
            assert quantize_checkpoint(checkpoint("llama"), made[scheme], SCHEMES[scheme]) == 2 * 7
        return made[scheme]

    return get


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_quantize_then_load_round_trips(scheme, quantized, checkpoint):
    source, path = read_tensors(checkpoint("llama")), quantized(scheme)
    config = json.loads((path / "config.json").read_text())
    scheme_read = parse_quantization_config(config["quantization_config"])
    assert config["quantization_config"] == quantization_config(SCHEMES[scheme])
    stored = read_tensors(path)
    assert stored["lm_head.weight"].dtype == torch.float32 and stored["model.embed_tokens.weight"].dtype == torch.float32
    module = "model.layers.1.mlp.down_proj"
    with Checkpoint(path) as files:
        q = read_quantized(files, scheme_read, module, (128, 256), None, None, torch.device("cpu"))
    expected = quantize(source[module + ".weight"], SCHEMES[scheme])
    assert torch.equal(q.weight.view(torch.int8), expected.weight.view(torch.int8))
    torch.testing.assert_close(dequantize(q), dequantize(expected), atol=0, rtol=0)
    llm = LLM(str(path), num_blocks=16)
    layer = llm.engine.runner.model.weights.layers[0]
    kind = Int8Linear if scheme == "int8" else Linear  # FP8 runs dequantized on CPU
    assert all(isinstance(p, kind) for p in (layer.attention.qkv_proj, layer.attention.o_proj, layer.gate_up_proj, layer.down_proj))
    if scheme == "int8":  # the cpu backend's loops take the passes around the GEMM
        assert llm.engine.runner.backend == "cpu" and layer.attention.qkv_proj.fused is not None
    assert isinstance(llm.engine.runner.model.weights.lm_head, Linear)
    out = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_slices_and_fusions_of_quantized_weights_equal_the_whole_s(scheme, quantized):
    """A tensor-parallel rank's row or column slice, and fused q/k/v, dequantize as the whole weight's part."""
    path = quantized(scheme)
    scheme_read = parse_quantization_config(json.loads((path / "config.json").read_text())["quantization_config"])
    cpu = torch.device("cpu")
    with Checkpoint(path) as files:
        def read(module, shape, rows=None, cols=None):
            return read_quantized(files, scheme_read, f"model.layers.0.{module}", shape, rows, cols, cpu)

        whole = dequantize(read("mlp.down_proj", (128, 256)))
        for cols in ((0, 128), (128, 256), (64, 192)):  # (64, 192) is off the 128-column block grid
            part = read("mlp.down_proj", (128, 256), cols=cols)
            part = part if isinstance(part, torch.Tensor) else dequantize(part)
            torch.testing.assert_close(part, whole[:, cols[0]:cols[1]], atol=0, rtol=0)
        gate = dequantize(read("mlp.gate_proj", (256, 128)))
        torch.testing.assert_close(dequantize(read("mlp.gate_proj", (256, 128), rows=(64, 200))), gate[64:200])
        parts = [read(f"self_attn.{x}_proj", shape) for x, shape in zip("qkv", [(128, 128), (64, 128), (64, 128)])]
        fused = fuse(parts)
        torch.testing.assert_close(dequantize(fused), torch.cat([dequantize(p) for p in parts]), atol=0, rtol=0)


def _logits(path, tokens):
    return position_logits(EngineConfig(model=str(path), num_blocks=16, block_size=16), [tokens])


# Teacher-forced over 200 tokens of the random 2-layer llama, measured: logits' relative error 0.044 (int8),
# 0.11-0.12 (FP8: 3 mantissa bits); top-1 agreement 0.94 and 0.80-0.82. The bounds leave a margin.
LOGIT_BOUNDS = {"int8": (0.07, 0.9), "fp8_dynamic": (0.17, 0.7), "fp8_block": (0.17, 0.7)}
CLEAR_GAP = 1.0  # a top-2 logit gap the quantization error (at most 0.3-0.8 here) does not flip


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_quantized_model_s_logits_and_greedy_tokens_follow_the_unquantized_model(scheme, quantized, checkpoint):
    tokens = torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    base, quant = _logits(checkpoint("llama"), tokens), _logits(quantized(scheme), tokens)
    max_error, min_agreement = LOGIT_BOUNDS[scheme]
    assert _relative(quant, base) < max_error
    assert (quant.argmax(-1) == base.argmax(-1)).float().mean() >= min_agreement
    top = base.topk(2, dim=-1).values
    clear = torch.nonzero(top[:, 0] - top[:, 1] > CLEAR_GAP).flatten().tolist()
    assert len(clear) >= 5
    # The engine's own greedy step, batched, at each position where the unquantized model is sure.
    outputs = LLM(str(quantized(scheme)), num_blocks=64).generate(
        [tokens[:p + 1] for p in clear], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert [o.token_ids[0] for o in outputs] == base.argmax(-1)[clear].tolist()


def test_modules_the_script_is_told_to_ignore_stay_unquantized(checkpoint, tmp_path):
    path = tmp_path / "mixed"
    assert quantize_checkpoint(checkpoint("llama"), path, WeightFormat.INT8_CHANNEL, (r"re:.*down_proj",)) == 2 * 6
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head", r"re:.*down_proj"]
    layer = LLM(str(path), num_blocks=16).engine.runner.model.weights.layers[1]
    assert isinstance(layer.down_proj, Linear) and isinstance(layer.gate_up_proj, Int8Linear)


def test_quantized_moe_experts_are_refused_and_the_script_leaves_them_out(checkpoint, tmp_path):
    source = checkpoint("qwen2_moe")
    done = tmp_path / "moe"
    quantize_checkpoint(source, done, WeightFormat.INT8_CHANNEL)
    llm = LLM(str(done), num_blocks=16)  # its shared expert's and dense layers' projections are int8
    assert isinstance(llm.engine.runner.model.weights.layers[1].moe.shared_down, Int8Linear)
    assert llm.generate([[3, 1, 4]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    broken = tmp_path / "experts"
    quantize_checkpoint(source, broken, WeightFormat.INT8_CHANNEL)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized MoE experts are not supported"):
        LLM(str(broken), num_blocks=16)


def test_a_quantized_lm_head_or_missing_scale_is_refused(quantized, tmp_path):
    tensors = read_tensors(quantized("int8"))
    scheme = QuantScheme(WeightFormat.INT8_CHANNEL, "weight_scale", ())
    with_head = quantize_tensors({"lm_head.weight": tensors["lm_head.weight"]}, scheme)
    assert with_head == {"lm_head.weight": tensors["lm_head.weight"]}  # the script never quantizes it
    q = quantize(tensors["lm_head.weight"], WeightFormat.INT8_CHANNEL)
    _rewrite(quantized("int8"), tmp_path / "head", {**tensors, "lm_head.weight": q.weight})
    with pytest.raises(ValueError, match="'lm_head.weight' is stored quantized"):
        LLM(str(tmp_path / "head"), num_blocks=16)
    del tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    _rewrite(quantized("int8"), tmp_path / "scale", tensors)
    with pytest.raises(ValueError, match="missing 'model.layers.0.self_attn.k_proj.weight_scale'"):
        LLM(str(tmp_path / "scale"), num_blocks=16)


def _rewrite(source, path, tensors):
    import shutil

    import safetensors.torch

    shutil.copytree(source, path)
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
