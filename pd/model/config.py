"""Model shapes read from an HF ``config.json``.

Accepts both dialects that ``transformers`` writes: RoPE as ``rope_scaling`` +
top-level ``rope_theta`` (older) or ``rope_parameters`` with ``rope_theta``
nested inside (newer), and ``dtype`` or ``torch_dtype``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pd.model.quant_scheme import QuantScheme, parse_quantization_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]

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
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _sliding_windows(raw: dict, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    if architecture == "Qwen3MoeForCausalLM":  # every layer, when on (HF's Qwen3MoeAttention)
        return (window if raw.get("use_sliding_window") else None,) * num_layers
    if raw.get("use_sliding_window") and window:
        first = raw.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


QWEN2_FAMILY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


def _qkv_bias(raw: dict, architecture: str) -> bool:
    """Qwen2's QKV projections have biases; Qwen2-MoE's follow its ``qkv_bias`` (default true)."""
    if architecture == "Qwen2ForCausalLM":
        return True
    if architecture == "Qwen2MoeForCausalLM":
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


def _moe_config(raw: dict, architecture: str, num_layers: int) -> MoeConfig | None:
    """The MoE block's config; both names for the expert count occur (``num_local_experts`` is the newer)."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    count_name = "num_local_experts" if raw.get("num_local_experts") is not None else "num_experts"
    num_experts = int(raw.get(count_name) or 0)
    if num_experts == 0 and architecture != "MixtralForCausalLM":  # HF: no MoE layer at all
        return None
    num_experts = _positive(raw, count_name)
    top_k = _positive(raw, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"config.json's num_experts_per_tok {top_k} exceeds its {count_name} {num_experts}")
    if architecture == "MixtralForCausalLM":
        return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=_positive(raw, "intermediate_size"),
                         renormalize=True, layers=(True,) * num_layers)
    step = _positive(raw, "decoder_sparse_step") if "decoder_sparse_step" in raw else 1
    dense = set(raw.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=_positive(raw, "moe_intermediate_size"),
                     renormalize=bool(raw.get("norm_topk_prob", False)), layers=layers,
                     shared_expert_intermediate_size=shared)


def model_config_from_dict(raw: dict) -> ModelConfig:
    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(
            f"architectures {architectures} are not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(raw, architecture),
            o_bias=architecture not in QWEN2_FAMILY and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_windows=_sliding_windows(raw, architecture, num_layers),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            moe=_moe_config(raw, architecture, num_layers),
            quantization=parse_quantization_config(raw.get("quantization_config")),
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
