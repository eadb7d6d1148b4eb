"""Load an HF checkpoint directory (single or sharded safetensors) into ``ModelWeights``.

An 8-bit checkpoint (``ModelConfig.quantization``, ``pd.model.quant_scheme``) has its quantized
linear layers read with their scales (``pd.model.quant_weights``) and built by
``pd.model.quant_linear``; every other tensor loads as in any checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pd.config import DTYPE_NAMES
from pd.model.config import ModelConfig
from pd.model.gqa import GqaWeights
from pd.model.linear import compute_dtype, make_linear
from pd.model.llama import LayerWeights, ModelWeights
from pd.model.mla_loader import load_mla_attention
from pd.model.moe import MoeWeights
from pd.model.quant_linear import QuantLinear, make_quantized_linear
from pd.model.quant_scheme import QuantScheme
from pd.model.quant_weights import QUANTIZED_DTYPES, QuantizedWeight, dequantize, fuse, read_quantized
from pd.model.tp import SINGLE, TPShard

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
logger = logging.getLogger(__name__)


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """``"auto"`` takes the checkpoint's dtype (float32 when it names none)."""
    if dtype == "auto":
        dtype = config.torch_dtype if config.torch_dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"model directory {model_dir} has no model.safetensors or model.safetensors.index.json")


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole (tests and tools; the engine reads through ``Checkpoint``)."""
    with Checkpoint(model_dir) as checkpoint:
        return {name: checkpoint.read(name) for name in checkpoint.names()}


class Checkpoint:
    """The checkpoint's safetensors files, open; reads a tensor, or only a slice of its rows or columns.

    A slice is read from the file as it is, so a tensor-parallel rank never
    holds more of a weight than its shard.
    """

    def __init__(self, model_dir: Path):
        self._handles = []
        self._where: dict[str, object] = {}
        for path in _safetensors_files(Path(model_dir)):
            if not path.is_file():
                raise ValueError(f"safetensors shard {path} is listed in the index but missing")
            try:
                handle = safe_open(str(path), framework="pt")
                self._handles.append((path, handle))
                for name in handle.keys():
                    self._where[name] = (path, handle)
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise ValueError(f"cannot read safetensors file {path}: it is corrupt or truncated ({exc})") from exc

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()
        self._where.clear()

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        _, handle = self._where[name]
        return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it (``F32``, ``BF16``, ``F8_E4M3``, ``I8``...)."""
        _, handle = self._where[name]
        return handle.get_slice(name).get_dtype()

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
             expert: int | None = None) -> torch.Tensor:
        """The tensor, or rows ``[start, stop)`` of dim 0, or columns of dim 1.

        With ``expert``, the tensor is a stack of experts' matrices (``[E, rows, cols]``): only that one is
        read, and ``rows`` and ``cols`` slice it.
        """
        path, handle = self._where[name]
        try:
            if rows is None and cols is None and expert is None:
                return handle.get_tensor(name)
            part = handle.get_slice(name)
            lead = () if expert is None else (slice(expert, expert + 1),)
            rows_index = slice(None) if rows is None else slice(*rows)
            cols_index = slice(None) if cols is None else slice(*cols)
            tensor = part[lead + (rows_index,)] if cols is None else part[lead + (rows_index, cols_index)]
            return tensor if expert is None else tensor[0]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"cannot read {name!r} from safetensors file {path}: it is corrupt or truncated "
                             f"({exc})") from exc


class _Weights:
    """Takes named tensors (or a rank's slice of them) out of a checkpoint, cast to the model's dtype and device."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
                 quant: QuantScheme | None = None):
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.device = device
        self.quant = quant
        self.num_bytes = 0  # what this rank holds, summed as it loads

    def __contains__(self, name: str) -> bool:
        return name in self.checkpoint

    def get(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None, expert: int | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight of full ``shape`` (checked), or its ``rows`` or ``cols`` slice (of one ``expert``'s
        matrix in a stack of them), in ``dtype`` (the model's unless given)."""
        if name not in self.checkpoint:
            raise ValueError(f"checkpoint is missing the weight {name!r}")
        found = self.checkpoint.shape(name)
        if found != shape:
            raise ValueError(f"weight {name!r} has shape {found}, config implies {shape}")
        stored = self.checkpoint.dtype(name)
        if stored in QUANTIZED_DTYPES:
            raise ValueError(f"weight {name!r} is stored quantized ({stored}), where this model reads an "
                             "unquantized one: only the attention and dense-MLP projections load quantized "
                             "(not embeddings, lm_head, MoE routers or experts); list the module in "
                             "quantization_config's ignore")
        tensor = self.checkpoint.read(name, rows, cols, expert).to(device=self.device, dtype=dtype or self.dtype)
        tensor = tensor.contiguous()
        self.num_bytes += tensor.numel() * tensor.element_size()
        return tensor

    def optional(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor | None:
        return self.get(name, shape, rows) if name in self else None

    def fused(self, names: list[str], shapes: list[tuple[int, ...]], rows: list[tuple[int, int] | None],
              required: bool = True) -> torch.Tensor | None:
        """The named tensors (each its ``rows``) concatenated along dim 0; None only when optional and all absent."""
        present = [name in self for name in names]
        if not required and not any(present):
            return None
        if not all(present):
            missing = [n for n, p in zip(names, present) if not p]
            raise ValueError(f"checkpoint is missing the weights {missing}")
        return torch.cat([self.get(n, s, r) for n, s, r in zip(names, shapes, rows)], dim=0)

    def linear(self, modules: list[str], shapes: list[tuple[int, int]], rows: list[tuple[int, int] | None],
               cols: tuple[int, int] | None = None) -> torch.Tensor | QuantizedWeight:
        """The weight of ``modules`` fused along dim 0 (each its ``rows``; ``cols`` of a single one): an
        8-bit ``QuantizedWeight`` where the checkpoint's scheme quantizes them, else a tensor as ``get``."""
        quantized = [self.quant is not None and self.quant.quantizes(m) for m in modules]
        if not any(quantized):
            if cols is not None:
                return self.get(modules[0] + ".weight", shapes[0], cols=cols)
            return self.fused([m + ".weight" for m in modules], shapes, rows)
        if not all(quantized):
            raise ValueError(f"{modules} are fused into one layer, so quantization_config must quantize all or "
                             f"none of them; it leaves out {[m for m, q in zip(modules, quantized) if not q]}")
        parts = [read_quantized(self.checkpoint, self.quant, m, s, r, cols, self.device)
                 for m, s, r in zip(modules, shapes, rows)]
        if any(isinstance(p, torch.Tensor) for p in parts):  # a block slice off the 128-column grid
            logger.info("%s: this rank's columns %s are off the 128-column block grid; the layer runs "
                        "dequantized (%s)", modules[0], cols, self.dtype)
            weight = torch.cat([p if isinstance(p, torch.Tensor) else dequantize(p) for p in parts])
            weight = weight.to(self.dtype)
            self.num_bytes += weight.numel() * weight.element_size()
            return weight
        weight = fuse(parts)
        self.num_bytes += weight.num_bytes
        return weight


def _build(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, w: _Weights, form: str,
           few_rows: bool) -> QuantLinear:
    if isinstance(weight, QuantizedWeight):
        return make_quantized_linear(weight, bias, w.dtype, form, few_rows)
    return make_linear(weight, bias, form, few_rows)


def _vocab_shard(w: _Weights, name: str, config: ModelConfig, shard: TPShard) -> torch.Tensor:
    """This rank's rows of a ``[vocab, hidden]`` weight, zero-padded to ``shard.vocab_rows``."""
    start, stop = shard.vocab(config)
    part = w.get(name, (config.vocab_size, config.hidden_size), rows=(start, stop) if shard.size > 1 else None)
    pad = shard.vocab_rows(config) - part.shape[0]
    if pad:
        part = torch.cat([part, part.new_zeros(pad, part.shape[1])])
    return part


def _row_parallel(w: _Weights, name: str, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
                  whole: bool, form: str, few_rows: bool) -> dict:
    """A row-parallel layer's fields: its bias in the GEMM when one rank runs it, else added after the all-reduce."""
    if whole:
        return {f"{name}_proj": _build(weight, bias, w, form, few_rows), f"{name}_bias": None}
    return {f"{name}_proj": _build(weight, None, w, form, few_rows), f"{name}_bias": bias}


def _layer(w: _Weights, config: ModelConfig, shard: TPShard, i: int, form: str, few_rows: bool,
           experts: tuple[int, ...] | None) -> LayerWeights:
    """Layer ``i``'s weights as rank ``shard`` holds them (see ``pd.model.tp``); an MoE layer's ``experts``
    as ``load_moe`` takes them."""
    h = config.hidden_size
    p = f"model.layers.{i}."
    if config.is_moe_layer(i):
        mlp_fields = {"gate_up_proj": None, "down_proj": None, "down_bias": None,
                      "moe": load_moe(w, config, shard, i, form, few_rows, experts)}
    else:
        mlp_fields = _dense_mlp(w, config, shard, p + "mlp.", form, few_rows)
    load_attention = load_mla_attention if config.mla is not None else _gqa_attention
    return LayerWeights(
        input_norm=w.get(p + "input_layernorm.weight", (h,)),
        attention=load_attention(w, config, shard, p + "self_attn.", form, few_rows),
        post_attention_norm=w.get(p + "post_attention_layernorm.weight", (h,)),
        **mlp_fields,
    )


def _gqa_attention(w: _Weights, config: ModelConfig, shard: TPShard, attn: str, form: str,
                   few_rows: bool) -> GqaWeights:
    """A grouped-query attention layer's weights (``attn``: its names' prefix): rank ``shard``'s heads."""
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    whole = shard.size == 1
    heads, kv_heads = shard.heads(config), shard.kv_heads(config)
    q_rows = None if whole else (heads[0] * hd, heads[1] * hd)
    kv_rows = None if whole else (kv_heads[0] * hd, kv_heads[1] * hd)
    return GqaWeights(
        qkv_proj=_build(
            w.linear([attn + f"{x}_proj" for x in "qkv"], [(q, h), (kv, h), (kv, h)], [q_rows, kv_rows, kv_rows]),
            w.fused([attn + f"{x}_proj.bias" for x in "qkv"], [(q,), (kv,), (kv,)], [q_rows, kv_rows, kv_rows],
                    required=False),
            w, form, few_rows,
        ),
        q_norm=w.get(attn + "q_norm.weight", (hd,)) if config.qk_norm else None,
        k_norm=w.get(attn + "k_norm.weight", (hd,)) if config.qk_norm else None,
        **_row_parallel(w, "o", w.linear([attn + "o_proj"], [(h, q)], [None], cols=q_rows),
                        w.optional(attn + "o_proj.bias", (h,)), whole, form, few_rows),
    )


def _dense_mlp(w: _Weights, config: ModelConfig, shard: TPShard, mlp: str, form: str, few_rows: bool) -> dict:
    """A dense MLP's fields (``mlp``: its names' prefix), rank ``shard``'s slice of its intermediate features."""
    h, inter = config.hidden_size, config.intermediate_size
    mlp_rows = None if shard.size == 1 else shard.intermediate(config)
    return {
        "gate_up_proj": _build(
            w.linear([mlp + "gate_proj", mlp + "up_proj"], [(inter, h), (inter, h)], [mlp_rows, mlp_rows]),
            w.fused([mlp + "gate_proj.bias", mlp + "up_proj.bias"], [(inter,), (inter,)], [mlp_rows, mlp_rows],
                    required=False),
            w, form, few_rows,
        ),
        **_row_parallel(w, "down", w.linear([mlp + "down_proj"], [(h, inter)], [None], cols=mlp_rows),
                        w.optional(mlp + "down_proj.bias", (h,)), shard.size == 1, form, few_rows),
    }


def load_moe(w: _Weights, config: ModelConfig, shard: TPShard, i: int, form: str, few_rows: bool,
             experts: tuple[int, ...] | None = None) -> MoeWeights:
    """Layer ``i``'s MoE block, its experts fused into ``[E, 2I, H]`` and ``[E, H, I]`` one slice at a time.

    ``experts`` (expert parallelism, ``pd.engine.ep``): the logical ids of the experts this rank holds, in
    its slot order, each whole, and the shared expert whole; None: every expert, ``shard``'s slice of each.

    The experts are per-expert tensors on disk (``experts.{e}.gate_proj``, Mixtral's ``w1``/``w3``/``w2``),
    or already stacked (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``, as
    recent ``transformers`` holds them). Either way each expert's rank slice is read into its place, so
    loading never holds more than one expert's matrix beside the fused weights.
    """
    moe, h = config.moe, config.hidden_size
    num_experts, inter = moe.num_experts, moe.intermediate_size
    arch = config.arch  # where the family keeps a layer's experts, and its names for their projections
    prefix, (gate_name, up_name, down_name) = arch.experts_prefix, arch.expert_names
    p = f"model.layers.{i}.{prefix}"
    if w.quant is not None and w.quant.quantizes(f"{p}experts.0.{gate_name}"):
        raise ValueError(f"layer {i}'s MoE experts are quantized in this checkpoint ({w.quant.format.value}): "
                         "quantized MoE experts are not supported (only attention and dense-MLP projections); "
                         "list them in quantization_config's ignore, or use an unquantized checkpoint")
    if experts is not None:
        shard = SINGLE
    start, stop = (0, inter) if shard.size == 1 else shard.expert_intermediate(config)
    local = stop - start
    held = range(num_experts) if experts is None else experts
    dtype = compute_dtype(w.device, w.dtype)  # where bf16 has no native GEMM here, the experts hold fp32
    w13 = torch.empty(len(held), 2 * local, h, dtype=dtype, device=w.device)
    w2 = torch.empty(len(held), h, local, dtype=dtype, device=w.device)
    stacked = p + "experts.gate_up_proj" in w
    for slot, e in enumerate(held):
        if not 0 <= e < num_experts:
            raise ValueError(f"layer {i}: expert {e} is not one of the model's {num_experts}")
        if stacked:
            stack_shape = (num_experts, 2 * inter, h)
            w13[slot, :local] = w.get(p + "experts.gate_up_proj", stack_shape, (start, stop), expert=e, dtype=dtype)
            w13[slot, local:] = w.get(p + "experts.gate_up_proj", stack_shape, (inter + start, inter + stop),
                                      expert=e, dtype=dtype)
            w2[slot] = w.get(p + "experts.down_proj", (num_experts, h, inter), cols=(start, stop), expert=e,
                             dtype=dtype)
            continue
        expert = f"{p}experts.{e}."
        w13[slot, :local] = w.get(f"{expert}{gate_name}.weight", (inter, h), (start, stop), dtype=dtype)
        w13[slot, local:] = w.get(f"{expert}{up_name}.weight", (inter, h), (start, stop), dtype=dtype)
        w2[slot] = w.get(f"{expert}{down_name}.weight", (h, inter), cols=(start, stop), dtype=dtype)
    weights = MoeWeights(gate=make_linear(w.get(p + "gate.weight", (num_experts, h)), None, form, few_rows),
                         w13=w13, w2=w2)
    if moe.shared_expert_intermediate_size:
        shared_config = dataclasses.replace(config, intermediate_size=moe.shared_expert_intermediate_size)
        fields = _dense_mlp(w, shared_config, shard, p + arch.shared_expert, form, few_rows)
        weights.shared_gate_up, weights.shared_down = fields["gate_up_proj"], fields["down_proj"]
        if fields["down_bias"] is not None:
            raise ValueError(f"layer {i}'s shared expert has a down_proj bias, which {arch.name} does not")
        if moe.shared_expert_gated:
            weights.shared_expert_gate = make_linear(w.get(p + "shared_expert_gate.weight", (1, h)), None, form,
                                                     few_rows)
    if moe.scoring == "sigmoid":  # DeepSeek-V3's bias on the scores, for the choice of experts only
        weights.score_bias = w.get(p + "gate.e_score_correction_bias", (num_experts,), dtype=torch.float32)
    return weights


def load_weights(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 shard: TPShard = SINGLE, linear_form: str = "onednn", few_rows: bool = False,
                 experts: tuple[int, ...] | None = None) -> ModelWeights:
    """The weights rank ``shard`` runs (all of them at ``SINGLE``), read from the files slice by slice.

    ``linear_form``: the dense layers' form (``pd.model.linear.FORMS``); ``few_rows``: see ``make_linear``;
    ``experts``: the experts an expert-parallel rank holds in every MoE layer (see ``load_moe``).
    """
    with Checkpoint(model_dir) as checkpoint:
        w = _Weights(checkpoint, dtype, device, config.quantization)
        layers = [_layer(w, config, shard, i, linear_form, few_rows, experts) for i in range(config.num_layers)]
        embed = _vocab_shard(w, "model.embed_tokens.weight", config, shard)
        if config.tie_word_embeddings:
            lm_head = make_linear(embed, None, linear_form, few_rows)
        elif "lm_head.weight" in w:
            lm_head = make_linear(_vocab_shard(w, "lm_head.weight", config, shard), None, linear_form, few_rows)
        else:
            raise ValueError("checkpoint is missing the weight 'lm_head.weight' and tie_word_embeddings is false")
        norm = w.get("model.norm.weight", (config.hidden_size,))
        return ModelWeights(embed_tokens=embed, layers=layers, norm=norm, lm_head=lm_head, num_bytes=w.num_bytes,
                            vocab_start=shard.vocab(config)[0])
