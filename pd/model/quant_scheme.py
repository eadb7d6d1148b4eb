"""Which 8-bit weight scheme a checkpoint's ``config.json`` declares, read from its ``quantization_config``.

Two dialects, as hub checkpoints write them:

- ``quant_method: compressed-tensors`` (llm-compressor's output; vLLM's ``CompressedTensorsW8A8Fp8`` and
  ``CompressedTensorsW8A8Int8``): one entry of ``config_groups`` whose ``weights`` are 8-bit, symmetric,
  static, per output channel (``strategy: channel``, scales ``weight_scale [out, 1]``; ``tensor``, one scale,
  is read as every channel having it) or FP8 in 128x128 blocks (``strategy: block``), and whose
  ``input_activations`` are of the same type, symmetric and dynamic, per token (per 128-column group
  for blocks). ``format`` is ``float-quantized`` (FP8 e4m3) or ``int-quantized`` (int8).
- ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` (DeepSeek-V3 and Qwen3-FP8; vLLM's
  ``Fp8LinearMethod`` with block quantization): e4m3 weights with ``weight_scale_inv`` of shape
  ``[ceil(out/128), ceil(in/128)]`` (despite the name, the dequantization multiplier) and dynamic
  activations per token and 128-column group.

Whatever else a checkpoint declares is refused with a ``ValueError`` naming the field, never loaded
as something it is not. A module listed in ``ignore`` (``ignored_layers``, ``modules_to_not_convert``)
is stored unquantized.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

# The only block shape read: every public block-FP8 checkpoint uses it, and it is the kernels' K group.
BLOCK = (128, 128)
COMPRESSED_TENSORS = "compressed-tensors"
FORMAT_OF_TYPE = {"float": "float-quantized", "int": "int-quantized"}


class WeightFormat(enum.Enum):
    """How a quantized linear layer's weight is stored and multiplied."""

    INT8_CHANNEL = "int8_channel"  # int8 weight, fp32 scale per output channel; int8 activations per token
    FP8_CHANNEL = "fp8_channel"  # e4m3 weight, fp32 scale per output channel; FP8 activations per token
    FP8_BLOCK = "fp8_block"  # e4m3 weight, a scale per 128x128 block; FP8 activations per token and 128 columns


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's 8-bit scheme: the format of its quantized layers and which modules are left out."""

    format: WeightFormat
    scale_name: str  # the scale tensor beside each ``weight``: "weight_scale" or "weight_scale_inv"
    ignore: tuple[str, ...] = ()  # module names, or "re:<regex>" patterns, stored unquantized
    targets: tuple[str, ...] = ("Linear",)

    @property
    def block(self) -> tuple[int, int] | None:
        return BLOCK if self.format is WeightFormat.FP8_BLOCK else None

    def quantizes(self, module: str) -> bool:
        """Whether the linear module named ``module`` (``model.layers.0.self_attn.q_proj``) is stored quantized."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return False
        return any(target == "Linear" or _matches(target, module) for target in self.targets)


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' rule: ``re:`` patterns match from the name's start; names match whole, or as the
    name's last dotted parts (``lm_head``, ``layers.0.mlp.down_proj``)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def parse_quantization_config(raw: dict | None) -> QuantScheme | None:
    """The scheme ``config.json``'s ``quantization_config`` declares; None where it has none."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be an object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(raw)
    if method == "fp8":
        return _block_fp8(raw)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: "
                     f"{COMPRESSED_TENSORS!r} (W8A8 FP8 and INT8) and 'fp8' (block FP8)")


def _names(raw: dict, field: str) -> tuple[str, ...]:
    value = raw.get(field) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config.{field} must be a list of module names, got {value!r}")
    return tuple(value)


def _block_fp8(raw: dict) -> QuantScheme:
    where = "quantization_config"
    if raw.get("activation_scheme") != "dynamic":
        raise ValueError(f"{where}.activation_scheme {raw.get('activation_scheme')!r} is not supported: only "
                         "'dynamic' activation scales are (static ones need calibrated input scales)")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}.fmt {raw.get('fmt')!r} is not supported: only 'e4m3'")
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError(f"{where}.weight_block_size is missing: per-tensor FP8 (quant_method 'fp8' without "
                         f"blocks) is not supported, only {list(BLOCK)} blocks")
    if list(block) != list(BLOCK):
        raise ValueError(f"{where}.weight_block_size {block!r} is not supported: only {list(BLOCK)}")
    ignore = _names(raw, "ignored_layers") or _names(raw, "modules_to_not_convert")
    return QuantScheme(WeightFormat.FP8_BLOCK, "weight_scale_inv", ignore)


def _compressed_tensors(raw: dict) -> QuantScheme:
    where = "quantization_config"
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status {status!r} is not supported: only 'compressed' checkpoints")
    kv = raw.get("kv_cache_scheme")
    if kv is not None and (not isinstance(kv, dict) or kv.get("num_bits") != 8 or kv.get("type") != "float"):
        raise ValueError(f"{where}.kv_cache_scheme {kv!r} is not supported: only 8-bit float (FP8) KV, whose "
                         "k_scale/v_scale tensors an engine with an FP8 kv_cache_dtype reads (pd.model.kv_scales)")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"{where}.config_groups must hold exactly one group (one scheme for every quantized "
                         f"layer), got {len(groups) if isinstance(groups, dict) else groups!r}")
    (name, group), = groups.items()
    at = f"{where}.config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"{at} must be an object, got {group!r}")
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict):
        raise ValueError(f"{at}.weights is missing: activation-only schemes are not supported")
    if not isinstance(inputs, dict):
        raise ValueError(f"{at}.input_activations is missing: weight-only schemes (W8A16) are not supported, "
                         "only W8A8 with dynamic activation scales")
    if group.get("output_activations") is not None:
        raise ValueError(f"{at}.output_activations is not supported")
    kind = _check_args(weights, f"{at}.weights", weight=True)
    input_kind = _check_args(inputs, f"{at}.input_activations", weight=False)
    if input_kind != kind:
        raise ValueError(f"{at}.input_activations.type {input_kind!r} differs from weights.type {kind!r}: "
                         "only same-type W8A8 is supported")
    weight_strategy, input_strategy = weights.get("strategy"), inputs.get("strategy")
    block = weight_strategy == "block"
    if block and kind != "float":
        raise ValueError(f"{at}.weights.strategy 'block' is supported for float (FP8) weights only")
    wanted = "group" if block else "token"
    if input_strategy != wanted:
        raise ValueError(f"{at}.input_activations.strategy {input_strategy!r} is not supported with weights."
                         f"strategy {weight_strategy!r}: only {wanted!r}")
    if block and inputs.get("group_size") != BLOCK[1]:
        raise ValueError(f"{at}.input_activations.group_size {inputs.get('group_size')!r} is not supported: "
                         f"only {BLOCK[1]}, the weights' block columns")
    fmt = group.get("format") or raw.get("format")
    if fmt != FORMAT_OF_TYPE[kind]:
        raise ValueError(f"{where}.format {fmt!r} is not supported for {kind} weights: only "
                         f"{FORMAT_OF_TYPE[kind]!r}")
    targets = _names(group, "targets")
    if not targets:
        raise ValueError(f"{at}.targets is empty: it names the layers the scheme quantizes (e.g. ['Linear'])")
    for target in targets:
        if target != "Linear" and not target.startswith("re:"):
            raise ValueError(f"{at}.targets entry {target!r} is not supported: only 'Linear' and 're:' patterns")
    if block:
        weight_format = WeightFormat.FP8_BLOCK
    else:
        weight_format = WeightFormat.FP8_CHANNEL if kind == "float" else WeightFormat.INT8_CHANNEL
    return QuantScheme(weight_format, "weight_scale", _names(raw, "ignore"), targets)


def _check_args(args: dict, at: str, weight: bool) -> str:
    """Check one ``QuantizationArgs``; returns its type (``int`` or ``float``)."""
    if args.get("num_bits") != 8:
        raise ValueError(f"{at}.num_bits {args.get('num_bits')!r} is not supported: only 8-bit")
    kind = args.get("type")
    if kind not in FORMAT_OF_TYPE:
        raise ValueError(f"{at}.type {kind!r} is not supported: only 'int' and 'float'")
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{at}.symmetric is false: asymmetric (zero-point) quantization is not supported")
    if args.get("actorder") not in (None, False):
        raise ValueError(f"{at}.actorder {args.get('actorder')!r} is not supported")
    strategy = args.get("strategy")
    if weight:
        if args.get("dynamic", False) is not False:
            raise ValueError(f"{at}.dynamic must be false: weights have stored scales")
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"{at}.strategy {strategy!r} is not supported: only 'channel', 'tensor' and "
                             "'block' (FP8, 128x128)")
        if strategy == "block" and list(args.get("block_structure") or []) != list(BLOCK):
            raise ValueError(f"{at}.block_structure {args.get('block_structure')!r} is not supported: "
                             f"only {list(BLOCK)}")
        if strategy != "block" and args.get("group_size") is not None:
            raise ValueError(f"{at}.group_size {args.get('group_size')!r} is not supported with strategy "
                             f"{strategy!r}")
    elif args.get("dynamic") is not True:
        raise ValueError(f"{at}.dynamic is {args.get('dynamic')!r}: static activation scales are not supported, "
                         "only dynamic ones (computed per token at run time)")
    return kind


def _args(kind: str, strategy: str, dynamic: bool, **extra) -> dict:
    """One ``QuantizationArgs`` as compressed-tensors serialises it."""
    return {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}, **extra}


def quantization_config(weight_format: WeightFormat, ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    """The ``quantization_config`` a checkpoint of ``weight_format`` carries, as llm-compressor writes
    channel-wise W8A8 (``FP8_DYNAMIC``, ``W8A8`` presets) and DeepSeek-V3 writes block FP8."""
    if weight_format is WeightFormat.FP8_BLOCK:
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(BLOCK), "ignored_layers": list(ignore)}
    kind = "float" if weight_format is WeightFormat.FP8_CHANNEL else "int"
    group = {"targets": ["Linear"], "weights": _args(kind, "channel", False),
             "input_activations": _args(kind, "token", True), "output_activations": None, "format": None}
    return {"quant_method": COMPRESSED_TENSORS, "format": FORMAT_OF_TYPE[kind], "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None,
            "global_compression_ratio": None}
