"""Random HF models in the shapes the GPU benchmarks use, built once per machine and cached.

``SHAPES`` names each shape: a Llama-3-8B-shaped dense model and a Qwen3-30B-A3B-shaped MoE (128 experts,
8 a token: the fused MoE's Triton kernels), the two of the issue's GPU figures, and a tiny one of each
architecture for the CPU tests. ``build_model`` makes one with seeded random weights (``initializer_range``
0.02); ``cached_checkpoint`` saves one in bf16 under ``$PD_GPU_CHECK_CACHE`` (default ``/tmp/pd-gpu-check``)
the first time it is asked for and returns that directory after, so the parts of ``make gpu-check`` that
share a model (``bench.gpu_engine``, ``bench.decode_roofline``) build and write it once: writing the 16 GB
of the 8B shape takes about 20 s on the H200 machine.

``python -m bench.random_models llama3-8b:32 qwen3-30b-a3b:8`` fills the cache (``make gpu-check`` runs it
beside its correctness parts, before the timed ones). One process builds a given entry at a time: it
writes into a scratch folder and renames it into place when whole, so a build killed halfway leaves no
entry, and the next build clears its scratch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CACHE_ENV = "PD_GPU_CHECK_CACHE"
DEFAULT_CACHE = Path("/tmp/pd-gpu-check")
INITIALIZER_RANGE = 0.02
SEED = 0


@dataclass(frozen=True)
class ModelShape:
    """An architecture and its HF config's keyword arguments, all but the layer count."""

    moe: bool
    config: dict

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def num_heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.config["num_key_value_heads"]

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim", self.hidden_size // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]


LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=8192,
                     rms_norm_eps=1e-6)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=1024)
TINY_MOE = dict(TINY_LLAMA, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                head_dim=16)

SHAPES = {
    "llama3-8b": ModelShape(moe=False, config=LLAMA3_8B),
    "qwen3-30b-a3b": ModelShape(moe=True, config=QWEN3_30B_A3B),
    "tiny-llama": ModelShape(moe=False, config=TINY_LLAMA),
    "tiny-moe": ModelShape(moe=True, config=TINY_MOE),
}


def build_model(name: str, num_layers: int, device: str | torch.device, dtype: torch.dtype = torch.bfloat16):
    """``name``'s shape with ``num_layers`` layers and seeded random weights, built on ``device`` in ``dtype``.

    Built under ``dtype`` as the default dtype, so buffers HF computes in fp32 (the rotary inverse
    frequencies) stay fp32, as ``from_pretrained(dtype=...)`` leaves them; ``model.to(dtype)`` would round them.
    """
    import transformers

    shape = SHAPES[name]
    config_class, model_class = ((transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM) if shape.moe
                                 else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    config = config_class(num_hidden_layers=num_layers, initializer_range=INITIALIZER_RANGE, **shape.config)
    torch.manual_seed(SEED)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def cached_checkpoint(name: str, num_layers: int, device: str = "cuda") -> tuple[Path, object | None]:
    """The cached bf16 checkpoint of ``name`` at ``num_layers``, and the HF model if this call built it
    (on ``device``; None when the cache already held it)."""
    path = cache_root() / f"{name}-{num_layers}l"
    if path.is_dir():
        return path, None
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{path.name}.scratch-*"):
        shutil.rmtree(stale, ignore_errors=True)
    model = build_model(name, num_layers, device)
    scratch = path.parent / f"{path.name}.scratch-{os.getpid()}"
    model.save_pretrained(scratch)
    os.replace(scratch, path)
    return path, model


def load_cached(name: str, num_layers: int, device: str = "cuda") -> tuple[Path, object]:
    """The cached checkpoint and its HF model in bf16 on ``device``: built and saved now, or read back."""
    path, model = cached_checkpoint(name, num_layers, device)
    if model is None:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    return path, model


def _entry(text: str) -> tuple[str, int]:
    name, _, layers = text.partition(":")
    if name not in SHAPES or not layers.isdigit():
        raise argparse.ArgumentTypeError(f"expected SHAPE:LAYERS with SHAPE one of {sorted(SHAPES)}, got {text!r}")
    return name, int(layers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("entries", nargs="+", type=_entry, help="SHAPE:LAYERS, e.g. llama3-8b:32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    for name, num_layers in args.entries:
        started = time.monotonic()
        path, built = cached_checkpoint(name, num_layers, args.device)
        print(json.dumps({"case": "random_model", "model": name, "layers": num_layers, "path": str(path),
                          "built": built is not None, "seconds": round(time.monotonic() - started, 1)}), flush=True)
        del built
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
