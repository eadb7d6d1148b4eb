"""Model shapes read from an HF ``config.json``.

Accepts both dialects that ``transformers`` writes: RoPE as ``rope_scaling`` +
top-level ``rope_theta`` (older) or ``rope_parameters`` with ``rope_theta``
nested inside (newer), and ``dtype`` or ``torch_dtype``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pd.model.architectures import ARCHITECTURES, MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, Architecture
from pd.model.quant_scheme import QuantScheme, parse_quantization_config

__all__ = ["MOE_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "MlaConfig", "ModelConfig", "MoeConfig", "RopeConfig",
           "load_model_config", "model_config_from_dict"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (HF's ``_compute_yarn_parameters``): the ramp's bounds, and the cos/sin scale (``attention_factor``,
    # else derived from ``mscale`` and ``mscale_all_dim``); MLA also scales its softmax by ``mscale_all_dim``.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention's shape (DeepSeek-V2/V3): each token's KV is one latent of
    ``kv_lora_rank`` values (normalised) plus one shared rotary key of ``qk_rope_head_dim``."""

    q_lora_rank: int | None  # None: a full-rank q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The checkpoint's rotary dims are interleaved pairs (V2 always; V3's rope_interleave): the loader
    # permutes those weight rows to rotate-half order, which leaves every product unchanged.
    rope_interleave: bool = False
    attention_bias: bool = False  # biases on q_a_proj / q_proj, kv_a_proj_with_mqa and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The pool's one row per token and layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts' shape and routing, as HF runs it.

    Routing is a softmax in fp32 over all experts, then the top ``top_k``,
    renormalised to sum to one when ``renormalize`` (Mixtral always; Qwen's
    ``norm_topk_prob``). ``layers[i]`` says whether layer ``i``'s MLP is the
    MoE block or a dense MLP of ``ModelConfig.intermediate_size``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert, gated by sigmoid(shared_expert_gate(x))
    shared_expert_gated: bool = True  # False: DeepSeek's shared experts, added as they are
    # Routing beyond the softmax top-k (pd_kernels.select_experts): DeepSeek-V3's "noaux_tc" (sigmoid
    # scores, a bias for the choice only, groups scored by their top two), DeepSeek-V2's
    # "group_limited_greedy" (groups scored by their best); the chosen weights times ``routed_scaling_factor``.
    scoring: str = "softmax"  # or "sigmoid"
    topk_method: str = "greedy"  # or "group_limited_greedy", "noaux_tc"
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layers)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # One entry per layer: the window for sliding-window layers, None for full attention.
    sliding_windows: tuple[int | None, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None
    # An 8-bit checkpoint's scheme (``quantization_config``); None: unquantized weights.
    quantization: QuantScheme | None = None
    # Multi-head latent attention (``pd.model.mla``); None: grouped-query attention with per-head K/V.
    # With it, ``num_kv_heads`` is 1 (the latent, replicated over tensor-parallel ranks) and ``head_dim``
    # is the rotary key's (what the rotary table is built for).
    mla: MlaConfig | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def kv_head_dim(self) -> int:
        """A pool row's values: one KV head's ``head_dim``, or MLA's latent and rotary key."""
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def kv_planes(self) -> int:
        """Rows a token keeps per KV head and layer: K and V (2), or MLA's one latent (1)."""
        return 1 if self.mla is not None else 2

    @property
    def kv_values_per_token(self) -> int:
        """Values the pool keeps per token over all layers (times the element size: its bytes)."""
        return self.num_layers * self.kv_planes * self.num_kv_heads * self.kv_head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_config(raw: dict) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor")
        factor = float(factor) if factor is not None else int(raw["max_position_embeddings"]) / original
        attention_factor = params.get("attention_factor")
        return RopeConfig(
            theta=float(theta), rope_type="yarn", factor=factor, original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(params.get("truncate", True)),
        )
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _sliding_windows(raw: dict, arch: Architecture, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if arch.windows == "all":
        return (window,) * num_layers
    if arch.windows == "use_sliding_window":  # every layer, when on (HF's Qwen3MoeAttention)
        return (window if raw.get("use_sliding_window") else None,) * num_layers
    if arch.windows == "max_window_layers" and raw.get("use_sliding_window") and window:
        first = raw.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def _qkv_bias(raw: dict, arch: Architecture) -> bool:
    """Qwen2's QKV projections have biases; Qwen2-MoE's follow its ``qkv_bias`` (default true)."""
    if arch.qkv_bias == "always":
        return True
    if arch.qkv_bias == "qkv_bias":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", False))


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _positive(raw: dict, name: str) -> int:
    value = int(raw[name])
    if value < 1:
        raise ValueError(f"config.json's {name} must be >= 1, got {value}")
    return value


def _moe_config(raw: dict, arch: Architecture, num_layers: int) -> MoeConfig | None:
    """The MoE block's config; both names for the expert count occur (``num_local_experts`` is the newer)."""
    if arch.moe is None:
        return None
    if arch.moe == "deepseek":
        return _deepseek_moe_config(raw, arch, num_layers)
    count_name = "num_local_experts" if raw.get("num_local_experts") is not None else "num_experts"
    num_experts = int(raw.get(count_name) or 0)
    if num_experts == 0 and arch.moe != "mixtral":  # HF: no MoE layer at all
        return None
    num_experts = _positive(raw, count_name)
    top_k = _positive(raw, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"config.json's num_experts_per_tok {top_k} exceeds its {count_name} {num_experts}")
    if arch.moe == "mixtral":
        return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=_positive(raw, "intermediate_size"),
                         renormalize=True, layers=(True,) * num_layers)
    step = _positive(raw, "decoder_sparse_step") if "decoder_sparse_step" in raw else 1
    dense = set(raw.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch.shared_expert else 0
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=_positive(raw, "moe_intermediate_size"),
                     renormalize=bool(raw.get("norm_topk_prob", False)), layers=layers,
                     shared_expert_intermediate_size=shared)


DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _deepseek_moe_config(raw: dict, arch: Architecture, num_layers: int) -> MoeConfig:
    """DeepSeek's MoE as HF runs it: dense MLPs below ``first_k_dense_replace``, then routed experts plus
    ``n_shared_experts`` ungated shared ones. V3 always routes by ``noaux_tc`` (sigmoid, bias-corrected
    choice, groups by their top two, renormalised if ``norm_topk_prob``); V2 by softmax with ``topk_method``
    and never renormalises (HF's ``DeepseekV2TopkRouter``)."""
    count_name = "n_routed_experts" if "n_routed_experts" in raw else "num_local_experts"
    num_experts = _positive(raw, count_name)
    top_k = _positive(raw, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"config.json's num_experts_per_tok {top_k} exceeds its {count_name} {num_experts}")
    v3 = arch.name == "DeepseekV3ForCausalLM"
    method = "noaux_tc" if v3 else (raw.get("topk_method") or "greedy")
    if method not in DEEPSEEK_V2_TOPK_METHODS and not v3:
        raise ValueError(f"config.json's topk_method {method!r} is not supported for {arch.name}; supported: "
                         f"{', '.join(DEEPSEEK_V2_TOPK_METHODS)}")
    groups, topk_group = 1, 1
    if method != "greedy":
        groups, topk_group = _positive(raw, "n_group"), _positive(raw, "topk_group")
        if num_experts % groups:
            raise ValueError(f"config.json's n_group {groups} does not divide its {count_name} {num_experts}")
        if topk_group > groups:
            raise ValueError(f"config.json's topk_group {topk_group} exceeds its n_group {groups}")
        if method == "noaux_tc" and num_experts // groups < 2:
            raise ValueError(f"config.json's n_group {groups} leaves fewer than 2 experts a group; noaux_tc "
                             "scores a group by its top two")
        if top_k > topk_group * (num_experts // groups):
            raise ValueError(f"config.json's num_experts_per_tok {top_k} exceeds the experts of its topk_group "
                             f"{topk_group} groups")
    dense = int(raw.get("first_k_dense_replace") or 0)
    inter = _positive(raw, "moe_intermediate_size")
    return MoeConfig(
        num_experts=num_experts, top_k=top_k, intermediate_size=inter,
        renormalize=v3 and bool(raw.get("norm_topk_prob", True)), layers=tuple(i >= dense for i in range(num_layers)),
        shared_expert_intermediate_size=inter * int(raw.get("n_shared_experts") or 0), shared_expert_gated=False,
        scoring="sigmoid" if v3 else "softmax", topk_method=method, num_groups=groups, topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )


def _mla_config(raw: dict, arch: Architecture) -> MlaConfig | None:
    if arch.attention != "mla":
        return None
    q_lora_rank = raw.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_lora_rank is None else _positive(raw, "q_lora_rank"),
        kv_lora_rank=_positive(raw, "kv_lora_rank"), qk_nope_head_dim=_positive(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive(raw, "qk_rope_head_dim"), v_head_dim=_positive(raw, "v_head_dim"),
        # HF's V2 rotates interleaved pairs (complex rotary); V3 where rope_interleave says so (default true).
        rope_interleave=arch.name == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
    )


def _refuse_unsupported(raw: dict, arch: Architecture) -> None:
    """Fields of a config the engine cannot run as HF does, each named."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json's hidden_act {act!r} is not supported; supported: silu")
    if arch.attention == "mla" and raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json's partial_rotary_factor is not supported with multi-head latent attention")


def model_config_from_dict(raw: dict) -> ModelConfig:
    architectures = raw.get("architectures") or []
    name = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if name is None:
        raise ValueError(
            f"architectures {architectures} are not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[name]
    try:
        _refuse_unsupported(raw, arch)
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        mla = _mla_config(raw, arch)
        head_dim = mla.qk_rope_head_dim if mla is not None else raw.get("head_dim") or hidden_size // num_heads
        return ModelConfig(
            architecture=name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=1 if mla is not None else int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=mla is None and _qkv_bias(raw, arch),
            o_bias=arch.o_bias and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch.qk_norm,
            sliding_windows=_sliding_windows(raw, arch, num_layers),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            moe=_moe_config(raw, arch, num_layers),
            quantization=parse_quantization_config(raw.get("quantization_config")),
            mla=mla,
        )
    except KeyError as exc:
        raise ValueError(f"config.json is missing the field {exc.args[0]!r}") from exc


def load_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {model_dir} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return model_config_from_dict(raw)
