"""A one-off calibration of FP8 KV scales: ``python -m pd.kv_calibrate MODEL --text FILE... --out FILE``.

Runs the model (unquantized KV) over the text, takes each layer's largest
key and value magnitude from the pool after every prompt, and writes
``k_scale = max|K| / fp8_max`` and ``v_scale = max|V| / fp8_max`` per layer
(``--margin`` above 1 leaves headroom), as JSON that
``EngineConfig.kv_cache_scales`` reads (``pd.model.kv_scales``). The keys
are taken after the rotary embedding, as the pool stores them.

It is never run by a serving engine: every replica that exchanges KV must
hold the same scales, so they are fixed in a file before any replica starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pd.llm import LLM
from pd.sampling_params import SamplingParams
from pd_kernels.fp8 import FP8_NAMES, fp8_max


def calibrate(llm: LLM, prompts: list[list[int]], kv_cache_dtype: str, margin: float = 1.0) -> dict:
    """Each layer's scales from the keys and values ``prompts`` leave in ``llm``'s pool (an unquantized one)."""
    if llm.engine.runner.kv_dtype in FP8_NAMES.values():
        raise ValueError("calibrate over an unquantized KV cache: the engine's pool is FP8 already")
    if llm.engine.config.num_ranks > 1:
        raise ValueError("calibrate on one rank: a tensor-parallel rank's pool holds only its own heads")
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1 (headroom above the largest value seen), got {margin}")
    pool = llm.engine.runner.kv_cache  # [blocks, heads, layers, 2, block_size, head_dim]
    largest = torch.zeros(pool.shape[2], 2)
    for prompt in prompts:  # one at a time: a later prompt may take an earlier one's blocks
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        largest = torch.maximum(largest, pool.abs().float().amax(dim=(0, 1, 4, 5)))
    limit = fp8_max(FP8_NAMES[kv_cache_dtype])
    scales = torch.where(largest > 0, largest * margin / limit, torch.ones_like(largest))
    return {"k_scale": scales[:, 0].tolist(), "v_scale": scales[:, 1].tolist(),
            "source": f"kv_calibrate over {sum(map(len, prompts))} tokens, margin {margin}, for {kv_cache_dtype}"}


def _prompts(llm: LLM, texts: list[str], max_len: int) -> list[list[int]]:
    tokens = [t for text in texts for t in llm.tokenizer.encode(text)]
    return [tokens[i:i + max_len] for i in range(0, len(tokens), max_len) if len(tokens[i:i + max_len]) > 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--text", nargs="+", required=True, help="text files the model reads")
    parser.add_argument("--out", required=True, help="the scales file to write (JSON)")
    parser.add_argument("--kv-cache-dtype", choices=sorted(FP8_NAMES), default="fp8_e4m3")
    parser.add_argument("--margin", type=float, default=1.0)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    with LLM(args.model, dtype=args.dtype) as llm:
        if llm.tokenizer is None:
            raise SystemExit(f"{args.model} has no tokenizer: calibration reads text")
        prompts = _prompts(llm, [Path(p).read_text() for p in args.text], args.max_prompt_tokens)
        if not prompts:
            raise SystemExit("the text files hold fewer than two tokens")
        scales = calibrate(llm, prompts, args.kv_cache_dtype, args.margin)
    Path(args.out).write_text(json.dumps(scales, indent=1) + "\n")
    print(json.dumps({"out": args.out, "layers": len(scales["k_scale"]), "source": scales["source"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
