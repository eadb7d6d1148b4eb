"""Engine decode throughput on a GPU: ours (eager and CUDA graphs) against HF ``generate``.

``python -m bench.gpu_engine [--model llama3-8b|qwen3-30b-a3b] [--layers 32] [--batch 32]`` takes a
random Llama-3-8B-shaped (or Qwen3-30B-A3B-shaped: 128 experts, 8 a token, the fused MoE's Triton
kernels) checkpoint in bf16 from ``bench.random_models``' cache (built and saved there on first use),
loads it into HF on the GPU and into our engine, and times the same greedy workload (``--batch``
prompts of 128 tokens, 128 new tokens each) in three ways, alternating, medians of ``--repeats`` after
one short warm-up run of each:

- HF ``generate`` at that batch size (the peer);
- our engine with decode steps replayed from CUDA graphs;
- our engine with every step eager.

Prints one JSON line: tokens/s of each, the ratios (goal: graphs >= 1.5x HF),
the share of requests whose greedy tokens equal HF's and equal between our
two modes, and the GPU's name. Needs CUDA; without it prints one line saying
it was skipped.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from bench.random_models import SHAPES, load_cached
from pd.workload.stats import percentile

WARM_UP_TOKENS = 8  # compiles and captures what the timed runs use; their length adds nothing


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def run_ours(llm, prompts: list[list[int]], new_tokens: int, graphs) -> tuple[float, list[list[int]]]:
    from pd import SamplingParams

    llm.engine.runner.graphs = graphs
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start, [list(o.token_ids) for o in outputs]


def agree(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


@dataclass
class Engines:
    """What is timed: HF's model and our engine (its CUDA graphs kept to switch them back on), and with
    ``--async-scheduling`` a second engine launching ahead, or why it could not be had."""

    hf: Any
    llm: Any
    graphs: Any
    overlapped: Any = None
    overlap_error: str | None = None
    setup_s: float = 0.0


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"case": "gpu_engine", "skipped": "no CUDA device"}))
        return
    rng = random.Random(0)
    engines = load(args)
    warm_up(engines, random_prompts(rng, args))
    median, outputs = time_modes(engines, args, rng)
    print(json.dumps(summary(args, engines, median, outputs)), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("llama3-8b", "qwen3-30b-a3b"), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also a second engine with async scheduling, graphs (mode graphs_async)")
    return parser.parse_args(argv)


def pool_bytes(args: argparse.Namespace) -> int:
    """Each engine's KV pool: twice what the batch's sequences hold at their longest. HF's model and two
    engines share one GPU, so a pool sized for the GPU (16 GiB each) left HF none on an 80 GB H100."""
    from bench.decode_roofline import kv_bytes

    return kv_bytes(SHAPES[args.model], args.layers, 2 * args.batch * (args.prompt_len + args.new_tokens))


def load(args: argparse.Namespace) -> Engines:
    """The checkpoint into HF and into our engine (and the async one, if asked); timed as ``setup_s``."""
    from pd import LLM

    started = time.monotonic()
    path, hf = load_cached(args.model, args.layers)
    llm = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_bytes=pool_bytes(args),
              cuda_graph_max_batch=max(args.batch, 8))
    engines = Engines(hf, llm, llm.engine.runner.graphs)
    if args.async_scheduling:
        try:
            engines.overlapped = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_bytes=pool_bytes(args),
                                     cuda_graph_max_batch=max(args.batch, 8), async_scheduling=True)
        except Exception as exc:  # noqa: BLE001 - the other modes' figures still stand; the line names it
            engines.overlap_error = f"{type(exc).__name__}: {str(exc)[:300]}"
    engines.setup_s = time.monotonic() - started
    return engines


def modes(engines: Engines, new_tokens: int) -> dict[str, Callable[[list[list[int]]], tuple[float, list]]]:
    """Each mode's run of ``new_tokens`` tokens a prompt: (seconds, tokens of each prompt)."""
    llm, overlapped = engines.llm, engines.overlapped
    runs = {"hf": lambda p: run_hf(engines.hf, p, new_tokens),
            "graphs": lambda p: run_ours(llm, p, new_tokens, engines.graphs),
            "eager": lambda p: run_ours(llm, p, new_tokens, None)}
    if overlapped is not None:
        runs["graphs_async"] = lambda p: run_ours(overlapped, p, new_tokens, overlapped.engine.runner.graphs)
    return runs


def random_prompts(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    return [[rng.randrange(3, 128000) for _ in range(args.prompt_len)] for _ in range(args.batch)]


def warm_up(engines: Engines, prompts: list[list[int]]) -> None:
    """One short run of each mode; an async engine that fails it is dropped, and why kept."""
    for key, run in modes(engines, WARM_UP_TOKENS).items():
        try:
            run(prompts)
        except Exception as exc:  # noqa: BLE001 - only the async engine is new here: drop it, name why
            if key != "graphs_async":
                raise
            engines.overlapped, engines.overlap_error = None, f"{type(exc).__name__}: {str(exc)[:300]}"


def time_modes(engines: Engines, args: argparse.Namespace,
               rng: random.Random) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """The modes alternating on the same prompts, ``--repeats`` times: median tokens/s, and the last tokens."""
    timed = modes(engines, args.new_tokens)
    tok_s = {key: [] for key in timed}
    outputs = {}
    for _ in range(args.repeats):
        prompts = random_prompts(rng, args)
        for key, run in timed.items():
            elapsed, outputs[key] = run(prompts)
            tok_s[key].append(args.batch * args.new_tokens / elapsed)
    return {key: percentile(values, 50) for key, values in tok_s.items()}, outputs


def summary(args: argparse.Namespace, engines: Engines, median: dict[str, float],
            outputs: dict[str, list[list[int]]]) -> dict:
    """The JSON line: each mode's tokens/s, their ratios, and how far their greedy tokens agree."""
    overlap = {}
    if engines.overlapped is not None:
        overlap = {"graphs_async_tok_s": round(median["graphs_async"], 1),
                   "graphs_async_vs_hf": round(median["graphs_async"] / median["hf"], 3),
                   "graphs_async_vs_graphs": round(median["graphs_async"] / median["graphs"], 3),
                   "agree_async": agree(outputs["graphs_async"], outputs["graphs"])}
    graphs = engines.graphs
    return {
        "case": "gpu_engine", "model": args.model, "gpu": torch.cuda.get_device_name(), "layers": args.layers,
        "batch": args.batch, "hf_tok_s": round(median["hf"], 1), "graphs_tok_s": round(median["graphs"], 1),
        "eager_tok_s": round(median["eager"], 1),
        "graphs_vs_hf": round(median["graphs"] / median["hf"], 3),
        "eager_vs_hf": round(median["eager"] / median["hf"], 3),
        "graphs_vs_eager": round(median["graphs"] / median["eager"], 3),
        "graph_replays": graphs.replays if graphs is not None else 0,
        "agree_hf": agree(outputs["graphs"], outputs["hf"]), "agree_modes": agree(outputs["graphs"], outputs["eager"]),
        "setup_s": round(engines.setup_s, 1), "repeats": args.repeats, **overlap,
        **({"graphs_async_error": engines.overlap_error} if engines.overlap_error else {}),
    }


if __name__ == "__main__":
    main()
