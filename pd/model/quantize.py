"""``python -m pd.model.quantize --scheme {fp8_dynamic,int8,fp8_block} SRC DST``: an 8-bit checkpoint from ours.

``SRC`` is any model argument (``pd.model.paths``): a checkpoint directory, a GGUF file (dequantized
first, as the engine reads it: the shipped SmolLM2's Q4_1 included) or a built-in name. Every attention
and dense-MLP projection (q/k/v/o, gate/up/down) is quantized by round to nearest, with no calibration
data: absmax scales per output channel (``fp8_dynamic``, ``int8``) or per 128x128 block (``fp8_block``).
The embeddings, norms and ``lm_head`` stay as they are, and so do an MoE model's router and experts
(the engine loads quantized dense layers only). ``DST`` gets ``model.safetensors``, the source's other
files, and a ``config.json`` whose ``quantization_config`` is what llm-compressor writes for its
``FP8_DYNAMIC`` and ``W8A8`` presets (compressed-tensors) or what DeepSeek-V3 and Qwen3-FP8 carry
(block FP8), so that other engines load the result too.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import safetensors.torch
import torch

from pd.model.config import MOE_ARCHITECTURES
from pd.model.loader import read_tensors
from pd.model.paths import resolve_model_path
from pd.model.quant_scheme import QuantScheme, WeightFormat, parse_quantization_config, quantization_config
from pd.model.quant_weights import quantize

SCHEMES = {"fp8_dynamic": WeightFormat.FP8_CHANNEL, "int8": WeightFormat.INT8_CHANNEL,
           "fp8_block": WeightFormat.FP8_BLOCK}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What stays unquantized: the LM head; in MoE models the router, the shared expert's gate and the experts.
IGNORE = ("lm_head",)
MOE_IGNORE = (r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*\.experts\..*")
# Files of the source checkpoint not copied: the weights and their index are rewritten, config.json amended.
REWRITTEN = ("config.json", "model.safetensors.index.json")


def quantized_modules(tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> list[str]:
    """The modules (``model.layers.0.self_attn.q_proj``) whose ``.weight`` the scheme quantizes."""
    modules = []
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS and tensor.dim() == 2
                and scheme.quantizes(module)):
            modules.append(module)
    return modules


def quantize_tensors(tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every projection the scheme quantizes replaced by its 8-bit weight and
    scale (``weight_scale [out, 1]`` per channel, or ``weight_scale_inv`` per block)."""
    out = dict(tensors)
    for module in quantized_modules(tensors, scheme):
        q = quantize(tensors[module + ".weight"], scheme.format)
        out[module + ".weight"] = q.weight
        scale = q.scale if scheme.format is WeightFormat.FP8_BLOCK else q.scale[:, None]
        out[f"{module}.{scheme.scale_name}"] = scale.contiguous()
    return out


def quantize_checkpoint(src: Path, dst: Path, weight_format: WeightFormat, ignore: tuple[str, ...] = ()) -> int:
    """Write ``src``'s checkpoint quantized to ``dst`` (a new or empty directory); the number of layers quantized.

    ``ignore``: more modules to leave unquantized (names or ``re:`` patterns, as ``quantization_config``'s).
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"destination {dst} exists and is not empty")
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config") is not None:
        raise ValueError(f"{src} is already quantized ({raw['quantization_config'].get('quant_method')!r}); "
                         "quantize an unquantized checkpoint")
    is_moe = bool(set(raw.get("architectures") or ()) & set(MOE_ARCHITECTURES))
    config = quantization_config(weight_format, IGNORE + (MOE_IGNORE if is_moe else ()) + tuple(ignore))
    scheme = parse_quantization_config(config)  # what the engine will read back
    tensors = read_tensors(src)
    quantized = quantize_tensors(tensors, scheme)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in REWRITTEN:
            shutil.copy2(path, dst / path.name)
    safetensors.torch.save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**raw, "quantization_config": config}, indent=2) + "\n")
    return len(quantized_modules(tensors, scheme))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", required=True, choices=sorted(SCHEMES))
    parser.add_argument("src", help="checkpoint directory, .gguf file or built-in model name")
    parser.add_argument("dst", help="the new checkpoint's directory (created)")
    parser.add_argument("--ignore", nargs="*", default=[],
                        help="more modules left unquantized: names or 're:' patterns (e.g. 're:.*down_proj')")
    args = parser.parse_args(argv)
    source = resolve_model_path(args.src)
    count = quantize_checkpoint(source, Path(args.dst), SCHEMES[args.scheme], tuple(args.ignore))
    print(json.dumps({"src": str(source), "dst": args.dst, "scheme": args.scheme, "quantized_layers": count}))


if __name__ == "__main__":
    main()
