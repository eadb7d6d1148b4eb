"""The architectures the engine runs: one registry that the config parser, the loader, the GGUF converter,
the quantizer and tensor parallelism read.

Each entry says, as data, what sets a family apart: its attention (``"gqa"``:
per-head K/V in the pool, ``pd.model.llama``; ``"mla"``: one compressed latent
per token, ``pd.model.mla``), its MoE block's routing and weight names, where
its QKV biases, QK norms and sliding windows come from, and its name in GGUF
files. A new family is one entry here (and a module where its attention or
block is new).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str  # HF's class name, as config.json's ``architectures`` lists it
    attention: str = "gqa"  # "gqa" or "mla"
    # The MoE block: None (dense), "mixtral" (every layer), "qwen" (decoder_sparse_step / mlp_only_layers),
    # or "deepseek" (dense below first_k_dense_replace, grouped routing, ungated shared experts).
    moe: str | None = None
    # Where a layer's experts live and their gate, up and down projections' names.
    experts_prefix: str = "mlp."
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # The shared expert's module under the MoE block (None: the family has none) and whether a sigmoid
    # gate scales it.
    shared_expert: str | None = None
    shared_expert_gated: bool = True
    # QKV biases: "attention_bias" (the config's flag), "always" (Qwen2), "qkv_bias" (the config's flag,
    # default true: Qwen2-MoE). o_proj's bias follows attention_bias unless ``o_bias`` is False.
    qkv_bias: str = "attention_bias"
    o_bias: bool = True
    qk_norm: bool = False
    # Sliding windows: "all" (every layer, Mistral), "use_sliding_window" (every layer when on, Qwen3-MoE),
    # "max_window_layers" (layers from it on, when on: Qwen2/Qwen3), or None (the config's layer_types only).
    windows: str | None = "max_window_layers"
    gguf: str | None = None  # llama.cpp's name for it, where its GGUF files convert
    gguf_permuted: bool = False  # llama.cpp permuted its Q/K rows for its rotary layout

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", gguf="llama", gguf_permuted=True),
    Architecture("MistralForCausalLM", windows="all"),
    Architecture("Qwen2ForCausalLM", qkv_bias="always", o_bias=False, gguf="qwen2"),
    Architecture("Qwen3ForCausalLM", qk_norm=True, gguf="qwen3"),
    Architecture("MixtralForCausalLM", moe="mixtral", experts_prefix="block_sparse_moe.",
                 expert_names=("w1", "w3", "w2"), windows="all"),
    Architecture("Qwen2MoeForCausalLM", moe="qwen", shared_expert="shared_expert.", qkv_bias="qkv_bias",
                 o_bias=False),
    Architecture("Qwen3MoeForCausalLM", moe="qwen", qk_norm=True, windows="use_sliding_window"),
    Architecture("DeepseekV2ForCausalLM", attention="mla", moe="deepseek", shared_expert="shared_experts.",
                 shared_expert_gated=False, windows=None),
    Architecture("DeepseekV3ForCausalLM", attention="mla", moe="deepseek", shared_expert="shared_experts.",
                 shared_expert_gated=False, windows=None),
)}

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
MOE_ARCHITECTURES = tuple(name for name, a in ARCHITECTURES.items() if a.is_moe)
GGUF_ARCHITECTURES = {a.gguf: a for a in ARCHITECTURES.values() if a.gguf is not None}


def architecture(name: str) -> Architecture:
    """The registry's entry for ``name``, or a ``ValueError`` listing what is supported."""
    found = ARCHITECTURES.get(name)
    if found is None:
        raise ValueError(f"architecture {name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return found
