"""What 8-bit weights and an FP8 KV cache cost in accuracy, teacher-forced: ``python -m bench.quant_accuracy``.

``python -m bench.quant_accuracy [--model builtin:smollm2-135m-instruct] [--weights int8 fp8_dynamic fp8_block]
[--tokens 2560] [--window 512] [--fp8-activations] [--dtype float32] [--kv-cache-dtype fp8_e4m3]
[--kv-cache-scales FILE]``

With ``--weights none --kv-cache-dtype fp8_e4m3``, the FP8 KV cache's cost alone.

Builds a varied text (this repository's docs and code, and short passages in French, German, Spanish,
Italian, Portuguese and Dutch written for this bench), tokenizes it with the model's tokenizer and feeds
it, ``--window`` tokens a sequence, through the engine's own model (``position_logits``: the forward pass
the engine runs, its kernels, in chunks through the paged KV cache) twice: unquantized, and quantized
to each ``--weights`` scheme by ``pd.model.quantize`` (``none``: the unquantized model against itself,
the harness's zero; with ``--dtype bfloat16``, bf16 against fp32: a floor for what any 8-bit scheme can
reach). One JSON object per scheme: the share of positions where both models' top-1 tokens agree, the mean
KL divergence of the quantized model's next-token distribution from the unquantized one's (full
vocabulary, nats), and each model's mean negative log-likelihood of the text.

A CPU runs FP8 checkpoints dequantized (weights rounded to FP8, activations not): that is what the
engine's figures for ``fp8_*`` measure. ``--fp8-activations`` runs their layers as the CUDA path computes
them instead, W8A8 (``Fp8Linear``: activations rounded to FP8 per token, or per token and 128 columns),
with the Triton kernel's torch reference as the product.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

import pd.model.loader as loader
from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.model.attention import AttentionMetadata
from pd.model.paths import resolve_model_path
from pd.model.quant_linear import fp8_linear, make_quantized_linear
from pd.model.quant_scheme import WeightFormat
from pd.model.quantize import SCHEMES, quantize_checkpoint
from pd.model.tokenizer import Tokenizer
from pd.workload.host import cpu_flags, cpu_name
from pd_kernels.triton.scaled_mm import scaled_mm_reference

ROOT = Path(__file__).resolve().parent.parent
PASSAGES = [
    "Le serveur reçoit une requête, découpe le texte en jetons et choisit la réplique qui possède déjà le "
    "début de l'invite. Ensuite, le cache des clés et des valeurs passe d'une machine à l'autre sans copie "
    "inutile, et la réponse arrive mot après mot.",
    "Die Stadt liegt an einem breiten Fluss, über den sieben Brücken führen. Im Winter frieren die Ufer zu, "
    "und die Kinder laufen Schlittschuh, während die Händler auf dem Markt heißen Wein und Lebkuchen verkaufen.",
    "El modelo aprende a predecir la siguiente palabra. Cuando la frase es ambigua, reparte la probabilidad "
    "entre varias opciones; cuando el contexto es claro, casi toda la masa cae sobre una sola palabra.",
    "La cucina italiana cambia da una regione all'altra: al nord si usa il burro e il riso, al sud l'olio "
    "d'oliva, i pomodori e la pasta secca. Ogni famiglia difende la propria ricetta della domenica.",
    "O comboio partiu de Lisboa às oito da manhã e chegou ao Porto antes do almoço. Pela janela viam-se "
    "vinhas, pequenas aldeias brancas e, de vez em quando, o mar.",
    "Op zaterdag fietsen we langs de dijk naar het dorp van mijn grootouders. De wind komt altijd van voren, "
    "zegt mijn vader, ook als we terugrijden.",
]
SOURCES = ["docs/design.md", "docs/models.md", "docs/serving.md", "pd/engine/scheduler.py", "router/hashing.py",
           "pd/model/llama.py"]
SOURCE_CHARS = 3000


def varied_text() -> str:
    """Passages of prose in seven languages, Markdown and Python, interleaved."""
    parts = []
    for i, source in enumerate(SOURCES):
        parts.append((ROOT / source).read_text()[:SOURCE_CHARS])
        parts.append(PASSAGES[i % len(PASSAGES)])
    return "\n\n".join(parts + PASSAGES[len(SOURCES) % len(PASSAGES):])


@torch.inference_mode()
def position_logits(config: EngineConfig, windows: list[list[int]], chunk: int = 256) -> torch.Tensor:
    """The engine's fp32 logits ``[sum of window lengths, vocab]`` at every position of each window.

    Each window is one sequence from position 0, fed in chunks of ``chunk`` tokens through the paged KV
    pool (the first blocks, reused by the next window), as a chunked prefill runs it.
    """
    engine = LLMEngine(config)
    try:
        runner = engine.runner
        block_size = runner.block_size
        longest = max(len(w) for w in windows)
        num_blocks = -(-longest // block_size)
        if runner.kv_cache.shape[0] < num_blocks:
            raise ValueError(f"a window of {longest} tokens needs {num_blocks} KV blocks; the pool has "
                             f"{runner.kv_cache.shape[0]}")
        table = torch.arange(num_blocks, dtype=torch.int32, device=runner.device)[None]
        out = []
        for tokens in windows:
            for start in range(0, len(tokens), chunk):
                end = min(start + chunk, len(tokens))
                attn = AttentionMetadata(
                    slot_mapping=torch.arange(start, end, device=runner.device),
                    cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=runner.device),
                    seq_lens=torch.tensor([end], dtype=torch.int32, device=runner.device),
                    block_table=table, backend=runner.backend)
                ids = torch.tensor(tokens[start:end], device=runner.device)
                positions = torch.arange(start, end, device=runner.device)
                out.append(runner.model.forward(ids, positions, attn, runner.kv_views,
                                                torch.arange(end - start, device=runner.device)).float().cpu())
        return torch.cat(out)
    finally:
        engine.close()


@contextlib.contextmanager
def fp8_as_on_cuda() -> Iterator[None]:
    """While open, the loader builds FP8 layers as the CUDA path's ``Fp8Linear``, on the kernel's reference."""
    def build(q, bias, dtype, form, few_rows):
        if q.format is WeightFormat.INT8_CHANNEL:
            return make_quantized_linear(q, bias, dtype, form, few_rows)
        return fp8_linear(q, bias, mm=scaled_mm_reference)

    saved = loader.make_quantized_linear
    loader.make_quantized_linear = build
    try:
        yield
    finally:
        loader.make_quantized_linear = saved


def compare(base: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor) -> dict:
    """Top-1 agreement, mean KL(base || quant) and each model's mean NLL of ``targets``."""
    base_logp, quant_logp = base.log_softmax(-1), quant.log_softmax(-1)
    kl = (base_logp.exp() * (base_logp - quant_logp)).sum(-1)
    return {
        "top1_agreement": round(float((base.argmax(-1) == quant.argmax(-1)).float().mean()), 4),
        "mean_kl": float(f"{float(kl.mean()):.3e}"),
        "max_kl": float(f"{float(kl.max()):.3e}"),
        "base_nll": round(float(-base_logp.gather(1, targets[:, None]).mean()), 4),
        "quant_nll": round(float(-quant_logp.gather(1, targets[:, None]).mean()), 4),
    }


def windows_of(token_ids: list[int], num_tokens: int, window: int) -> list[list[int]]:
    if len(token_ids) < num_tokens + 1:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than the {num_tokens + 1} asked for")
    return [token_ids[s:s + window + 1] for s in range(0, num_tokens, window)]


def run(model: str, schemes: list[str], num_tokens: int, window: int, threads: int | None, dtype: str,
        fp8_activations: bool, kv_cache_dtype: str = "auto", kv_cache_scales: str | None = None) -> list[dict]:
    source = resolve_model_path(model)
    base_config = EngineConfig(model=str(source), num_blocks=-(-(window + 1) // 16) + 1, block_size=16,
                               dtype="float32", num_threads=threads)
    tokenizer = Tokenizer.from_dir(source)
    if tokenizer is None:
        raise ValueError(f"model {model} has no tokenizer to read the text with")
    token_ids = tokenizer.encode(varied_text(), add_special_tokens=False)
    windows = windows_of(token_ids, num_tokens, window)
    # Position i predicts token i + 1 of its window: the last token of each window is a target only.
    targets = torch.tensor([t for w in windows for t in w[1:]])
    keep = torch.tensor([i < len(w) - 1 for w in windows for i in range(len(w))])
    base = position_logits(base_config, windows)[keep]
    results = []
    for scheme in schemes:
        with tempfile.TemporaryDirectory() as tmp:
            quant_dir = source
            if scheme != "none":
                quant_dir = Path(tmp) / scheme
                quantize_checkpoint(source, quant_dir, SCHEMES[scheme])
            config = dataclasses.replace(base_config, model=str(quant_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                         kv_cache_scales=kv_cache_scales)
            emulate = fp8_activations and scheme.startswith("fp8")
            with fp8_as_on_cuda() if emulate else contextlib.nullcontext():
                quant = position_logits(config, windows)[keep]
        results.append({"case": "quant_accuracy", "model": model, "weights": scheme,
                        "activations": "fp8" if emulate else ("int8" if scheme == "int8" else dtype),
                        "kv_cache_dtype": kv_cache_dtype, "kv_cache_scales": kv_cache_scales,
                        "tokens": int(keep.sum()), "window": window, **compare(base, quant, targets),
                        "base_dtype": "float32", "dtype": dtype, "cpu": cpu_name(), "cpu_flags": cpu_flags()})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--weights", nargs="+", default=["int8", "fp8_dynamic", "fp8_block"],
                        choices=["none", *SCHEMES])
    parser.add_argument("--tokens", type=int, default=2560, help="teacher-forced positions (at least 2,000)")
    parser.add_argument("--window", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the compared engine's dtype (the unquantized reference runs fp32)")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="FP8 schemes as W8A8, as the CUDA path computes them (see the module's doc)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                        help="the compared engine's KV cache (with --weights none: the KV cache's cost alone)")
    parser.add_argument("--kv-cache-scales", default=None, help="its scales file (python -m pd.kv_calibrate)")
    args = parser.parse_args(argv)
    for result in run(args.model, args.weights, args.tokens, args.window, args.threads, args.dtype,
                      args.fp8_activations, args.kv_cache_dtype, args.kv_cache_scales):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
