"""A peft LoRA adapter directory, read and checked against its base model: ``load_adapter``.

peft's ``save_pretrained`` writes ``adapter_config.json`` and
``adapter_model.safetensors``, one ``lora_A`` ``[r, in_features]`` and one
``lora_B`` ``[out_features, r]`` per adapted linear layer, named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``.
The layer then computes ``x·Wᵀ + scaling · x·Aᵀ·Bᵀ``, with ``scaling`` =
``alpha / r`` (``alpha / sqrt(r)`` under rsLoRA), ``r`` and ``alpha`` per
module after ``rank_pattern`` / ``alpha_pattern``. That is all the engine
computes: every config field that changes it (DoRA, biases, trained
embeddings, layer replication, peft's other variants) is refused by name,
and so is every tensor outside the seven dense projections of a decoder
layer. Weights are read with safetensors only, never unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from pd.model.config import ModelConfig

__all__ = ["CONFIG_FILE", "LORA_MODULES", "WEIGHTS_FILE", "LoraAdapter", "LoraWeights", "load_adapter"]

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES  # what an adapter may target
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
DIGEST_SIZE = 16
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# peft's LoraConfig fields (0.21, and older releases' ``enable_lora`` / ``merge_weights``) that do not change
# what a saved adapter computes: bookkeeping, training, initialisation that leaves the base weights alone,
# which modules were targeted (the tensors say), and the fields checked below.
INERT_FIELDS = frozenset((
    "alpha_pattern", "auto_mapping", "base_model_name_or_path", "bias", "corda_config", "enable_lora",
    "ensure_weight_tying", "eva_config", "exclude_modules", "fan_in_fan_out", "inference_mode", "init_lora_weights",
    "layers_pattern", "layers_to_transform", "loftq_config", "lora_alpha", "lora_dropout", "lora_ga_config",
    "megatron_config", "megatron_core", "merge_weights", "peft_type", "peft_version", "qalora_group_size", "r",
    "rank_pattern", "revision", "runtime_config", "target_modules", "task_type", "use_rslora",
))
# Fields that change the math, refused when set (anything but null, false or empty); peft marks most of them
# ``is_lora_variant``.
VARIANT_FIELDS: Mapping[str, str] = MappingProxyType({
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported",
    "lora_bias": "a bias on LoRA's B is not supported",
    "modules_to_save": "fully trained modules saved beside the LoRA weights are not supported",
    "trainable_token_indices": "trained token embeddings are not supported",
    "target_parameters": "LoRA on parameters (MoE experts) is not supported",
    "layer_replication": "replicated layers are not supported",
    "use_qalora": "QALoRA is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA is not supported",
})
# Initialisations that rewrite the base weights (W - scaling·B·A): the adapter only fits that rewritten base,
# unless saved converted (``path_initial_model_for_weight_conversion``, which records init_lora_weights true).
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# DeepSeek's multi-head latent attention projections (any self_attn module of an MLA model is refused too).
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# What sits under an MoE layer's ``mlp`` (routed and shared experts, routers); Mixtral's block is elsewhere.
MOE_PARTS = ("experts", "shared_expert", "shared_experts", "gate", "shared_expert_gate")
MIXTRAL_MOE_BLOCK = "block_sparse_moe"

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
# \______________/\_________________________________/\_____/
#  peft's wrapper    the module's name (peft's key)   half
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<name>model\.layers\.(?P<layer>\d+)\.(?P<path>[\w.]+?))"
                  r"\.lora_(?P<half>[AB])\.weight")


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class LoraWeights:
    """One adapted linear layer: it adds ``x · aᵀ · bᵀ`` to its output."""

    a: torch.Tensor  # [rank, in_features], as stored (lora_A.weight)
    b: torch.Tensor  # [out_features, rank], lora_B.weight times the module's scaling


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A peft LoRA adapter, checked against its base model; every tensor fp32 on CPU."""

    name: str
    path: Path
    # Hex blake2b (16 bytes) of the config's canonical JSON and the weights file's bytes: a reload with new
    # weights under the same name gets a new digest.
    digest: str
    rank: int  # the largest rank of any module
    modules: Mapping[tuple[int, str], LoraWeights]  # (layer index, module name from LORA_MODULES) -> weights
    num_bytes: int  # bytes of all a and b tensors


@dataclass(frozen=True)
class _Source:
    """Where an adapter comes from, for its errors."""

    name: str
    path: Path

    def error(self, detail: str) -> ValueError:
        return ValueError(f"LoRA adapter {self.name!r} at {self.path}: {detail}")


@dataclass(frozen=True)
class _Config:
    """The fields of ``adapter_config.json`` that shape the weights."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]

    def rank_and_scaling(self, module_name: str) -> tuple[int, float]:
        rank = self.rank_pattern.get(_pattern_key(self.rank_pattern, module_name), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module_name), self.alpha)
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _pattern_key(patterns: Mapping[str, object], module_name: str) -> str:
    """The first pattern (in the file's order) that matches the end of ``module_name`` at a dot boundary, as a
    regular expression; else the name itself. peft's rule (``peft.utils.other.get_pattern_key``)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return pattern
    return module_name


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read the peft adapter directory at ``path`` for the base model ``model``, refusing (``ValueError``, naming
    the adapter, its path and the field, tensor or module) whatever the engine would not compute as peft does,
    and any rank above ``max_rank``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"LoRA adapter name must be a non-empty string, got {name!r}")
    source = _Source(name, Path(path))
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise source.error(f"max_rank must be an integer >= 1, got {max_rank!r}")
    config_bytes, weights_bytes = _read_files(source)
    raw = _parse_json(source, config_bytes)
    config = _parse_config(source, raw)
    tensors = _parse_tensors(source, weights_bytes)
    modules = _check_modules(source, tensors, config, model, max_rank)
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in (canonical, weights_bytes):  # each length-prefixed: no two splits of the bytes hash alike
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return LoraAdapter(
        name=name, path=source.path, digest=digest.hexdigest(),
        rank=max(w.a.shape[0] for w in modules.values()), modules=MappingProxyType(modules),
        num_bytes=sum(t.numel() * t.element_size() for w in modules.values() for t in (w.a, w.b)),
    )


def _read_files(source: _Source) -> tuple[bytes, bytes]:
    """The config's and the weights' bytes, each read once: what is hashed is what is parsed."""
    if not source.path.is_dir():
        raise source.error("not a directory" if source.path.exists() else "no such directory")
    config_path, weights_path = source.path / CONFIG_FILE, source.path / WEIGHTS_FILE
    if not config_path.is_file():
        raise source.error(f"{CONFIG_FILE} is missing")
    if not weights_path.is_file():
        if (source.path / PICKLED_WEIGHTS_FILE).is_file():
            raise source.error(f"has {PICKLED_WEIGHTS_FILE} but no {WEIGHTS_FILE}: safetensors is needed, since "
                               "nothing received is unpickled (save it with safe_serialization=True)")
        raise source.error(f"{WEIGHTS_FILE} is missing")
    try:
        return config_path.read_bytes(), weights_path.read_bytes()
    except OSError as exc:
        raise source.error(f"cannot read its files ({exc})") from exc


def _parse_json(source: _Source, config_bytes: bytes) -> dict:
    try:
        raw = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise source.error(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise source.error(f"{CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _is_set(value: object) -> bool:
    return value is not None and value is not False and value != [] and value != {} and value != ""


def _parse_config(source: _Source, raw: dict) -> _Config:
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise source.error(f"{CONFIG_FILE} field 'peft_type' must be 'LORA', got {peft_type!r}")
    for field, reason in VARIANT_FIELDS.items():
        if _is_set(raw.get(field)):
            raise source.error(f"{CONFIG_FILE} field {field!r} is {raw[field]!r}: {reason}")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise source.error(f"{CONFIG_FILE} field 'bias' is {bias!r}: trained biases are not supported "
                           "(only 'none')")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise source.error(f"{CONFIG_FILE} field 'init_lora_weights' is {init!r}, which rewrites the base "
                           "weights: the adapter fits only that rewritten base (save it converted, with "
                           "path_initial_model_for_weight_conversion)")
    for field in sorted(raw.keys() - INERT_FIELDS - VARIANT_FIELDS.keys()):
        if _is_set(raw[field]):
            raise source.error(f"{CONFIG_FILE} field {field!r} is not one this engine knows (set to "
                               f"{raw[field]!r}); it may change what the adapter computes")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise source.error(f"{CONFIG_FILE} field 'use_rslora' must be true or false, got {use_rslora!r}")
    return _Config(
        r=_rank(source, "r", raw.get("r", 8)), alpha=_alpha(source, "lora_alpha", raw.get("lora_alpha", 8)),
        use_rslora=use_rslora,
        rank_pattern=_pattern(source, raw, "rank_pattern", _rank),
        alpha_pattern=_pattern(source, raw, "alpha_pattern", _alpha),
    )


def _rank(source: _Source, field: str, value: object, where: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise source.error(f"{CONFIG_FILE} field {field!r}{where} must be an integer >= 1, got {value!r}")
    return value


def _alpha(source: _Source, field: str, value: object, where: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise source.error(f"{CONFIG_FILE} field {field!r}{where} must be a finite number, got {value!r}")
    return float(value)


def _pattern(source: _Source, raw: dict, field: str, parse) -> Mapping[str, object]:
    patterns = raw.get(field) or {}
    if not isinstance(patterns, dict):
        raise source.error(f"{CONFIG_FILE} field {field!r} must be an object of patterns, got {patterns!r}")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise source.error(f"{CONFIG_FILE} field {field!r}: the key {pattern!r} is not a regular expression "
                               f"({exc})") from exc
    return MappingProxyType({p: parse(source, field, v, f" at key {p!r}") for p, v in patterns.items()})


def _parse_tensors(source: _Source, weights_bytes: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(weights_bytes)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise source.error(f"{WEIGHTS_FILE} is not a readable safetensors file: corrupt or truncated "
                           f"({exc})") from exc


def _module_of(source: _Source, key: str, model: ModelConfig) -> tuple[int, str, str, str]:
    """``(layer, module, module's full name, half)`` of a tensor's key, or why the engine cannot adapt it."""
    found = _KEY.fullmatch(key)
    if found is None:
        if any(part in key for part in ("embed_tokens", "lm_head", "lora_embedding_")):
            raise source.error(f"tensor {key!r}: LoRA on the embeddings or lm_head is not supported")
        raise source.error(f"tensor {key!r} is not a LoRA weight of a decoder layer's projection (expected "
                           "base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight)")
    layer, path = int(found["layer"]), found["path"]
    block, *inner, module = path.split(".")
    if layer >= model.num_layers:
        raise source.error(f"tensor {key!r}: layer {layer} is out of range, the base model has "
                           f"{model.num_layers} layers")
    if module in MLA_MODULES or (block == "self_attn" and model.mla is not None):
        raise source.error(f"tensor {key!r}: LoRA on multi-head latent attention is not supported")
    if block == MIXTRAL_MOE_BLOCK or (block == "mlp" and (inner or [module])[0] in MOE_PARTS):
        raise source.error(f"tensor {key!r}: LoRA on MoE experts, shared experts and routers is not supported")
    if inner or module not in {"self_attn": ATTENTION_MODULES, "mlp": MLP_MODULES}.get(block, ()):
        raise source.error(f"tensor {key!r}: module {path!r} is not one LoRA may target; supported: "
                           f"self_attn.{{{', '.join(ATTENTION_MODULES)}}} and mlp.{{{', '.join(MLP_MODULES)}}}")
    if block == "mlp" and model.is_moe_layer(layer):
        raise source.error(f"tensor {key!r}: layer {layer}'s MLP is a mixture of experts; LoRA on an MoE "
                           "layer's MLP is not supported")
    return layer, module, found["name"], found["half"]


def _features(model: ModelConfig, module: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of a dense projection of the base model."""
    hidden, inter = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (hidden, model.q_size), "k_proj": (hidden, model.kv_size), "v_proj": (hidden, model.kv_size),
        "o_proj": (model.q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def _check_modules(source: _Source, tensors: dict[str, torch.Tensor], config: _Config, model: ModelConfig,
                   max_rank: int) -> dict[tuple[int, str], LoraWeights]:
    """Every tensor placed, then each module's A and B checked against its rank and features, B scaled."""
    pairs: dict[tuple[int, str], _Pair] = {}
    for key in sorted(tensors):
        layer, module, module_name, half = _module_of(source, key, model)
        if tensors[key].dtype not in FLOAT_DTYPES:
            raise source.error(f"tensor {key!r} is {tensors[key].dtype}; LoRA weights must be floating point")
        pair = pairs.setdefault((layer, module), _Pair(module_name, {}))
        if half in pair.halves:
            raise source.error(f"tensors {pair.halves[half]!r} and {key!r} are both lora_{half} of "
                               f"{module_name!r}")
        pair.halves[half] = key
    if not pairs:
        raise source.error(f"{WEIGHTS_FILE} holds no LoRA weights")
    order = sorted(pairs, key=lambda where: (where[0], LORA_MODULES.index(where[1])))
    return {where: _weights(source, pairs[where], tensors, config, _features(model, where[1]), max_rank)
            for where in order}


@dataclass(frozen=True)
class _Pair:
    module_name: str  # peft's: model.layers.{i}.{self_attn|mlp}.{module}
    halves: dict[str, str]  # "A" / "B" -> the tensor's key


def _weights(source: _Source, pair: _Pair, tensors: dict[str, torch.Tensor], config: _Config,
             features: tuple[int, int], max_rank: int) -> LoraWeights:
    name = pair.module_name
    for half, other in (("A", "B"), ("B", "A")):
        if half not in pair.halves:
            raise source.error(f"module {name!r} has lora_{other} but no lora_{half}")
    rank, scaling = config.rank_and_scaling(name)
    if rank > max_rank:
        raise source.error(f"module {name!r} has rank {rank}, above max_rank {max_rank}")
    in_features, out_features = features
    a_key, b_key = pair.halves["A"], pair.halves["B"]
    for key, shape in ((a_key, (rank, in_features)), (b_key, (out_features, rank))):
        found = tuple(tensors[key].shape)
        if found != shape:
            raise source.error(f"tensor {key!r} has shape {found}, expected {shape} (module {name!r}: rank "
                               f"{rank}, {in_features} -> {out_features} features)")
    a = tensors[a_key].to(torch.float32).contiguous()
    b = (tensors[b_key].to(torch.float32) * scaling).contiguous()
    for key, tensor in ((a_key, a), (b_key, b)):
        if not torch.isfinite(tensor).all():
            raise source.error(f"tensor {key!r} holds NaN or infinite values")
    return LoraWeights(a=a, b=b)
