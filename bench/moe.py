"""The CPU fused MoE against HF's eager experts, a dense matmul and the memory bound: ``python -m bench.moe``.

``python -m bench.moe [--tokens 16 64 512] [--hidden 1024] [--inter 512] [--threads 2]
[--dtype float32|bfloat16] [--configs 8x2 16x4] [--repeats 15]``

For each (experts E, top-k k) config and token count T it times, alternating,
with the same routing (``pd_kernels.select_experts`` on random router logits):

- ``ours``: ``pd_kernels.fused_moe(..., backend="cpu")``;
- ``hf``: transformers' ``Qwen3MoeExperts`` with ``experts_implementation="eager"``
  (HF's loop over the experts hit), on the same weights;
- ``dense``: a dense SwiGLU MLP of one expert's shape on ``T * k`` rows, as the
  engine's dense layers run one (``pd.model.linear.make_linear``: oneDNN's GEMM
  on prepacked weights, the fastest dense form on this host): the same active
  FLOPs, one expert's weights;
- ``bound``: the time to read the distinct experts' weights that the routing
  touches at the stream bandwidth measured in the same run (the faster of a
  512 MiB sum and a 512 MiB copy, read plus write): no kernel that reads each
  touched expert once from memory beats it.

Each form cycles through copies of its weights adding up to at least
``CYCLE_BYTES``, past the last-level cache, as the layers of a forward pass
read theirs from memory. One JSON object: medians in ms and the ratios
``hf_over_ours``, ``dense_over_ours``, ``bound_over_ours`` (1.0 = at the memory
bound) and ``dense_over_bound`` (the highest ``dense_over_ours`` any kernel
could reach: the dense MLP reads one expert's weights, the MoE every one it
touches), with the CPU's name, its ISA flags and the extension's ISA level.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import pd_kernels
import pd_kernels.cpu
from pd.model.linear import make_linear
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile
from pd_kernels import reference

# Each form's weight copies add up to at least this: past a 32 MiB last-level cache, twice.
CYCLE_BYTES = 96 * 1024**2
# The tensor whose sum and copy measure the stream bandwidth.
STREAM_BYTES = 512 * 1024**2


def stream_bandwidth(repeats: int = 5) -> float:
    """Bytes per second this host streams from memory now: the faster of a sum (reads) and a copy (both)."""
    src = torch.ones(STREAM_BYTES // 4)
    dst = torch.empty_like(src)
    best = 0.0
    for moved, op in ((src.numel() * 4, src.sum), (2 * src.numel() * 4, lambda: dst.copy_(src))):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        best = max(best, moved / percentile(times[1:], 50))
    return best


def hf_experts(num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    """HF's eager Qwen3-MoE experts with random weights, and those weights as ``(w13, w2)``."""
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                                         num_experts_per_tok=top_k, experts_implementation="eager")
    torch.manual_seed(seed)
    experts = modeling_qwen3_moe.Qwen3MoeExperts(config).eval()
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(0, 0.02)
    experts = experts.to(dtype)
    return experts, (experts.gate_up_proj.detach(), experts.down_proj.detach())


def timed(forms: dict, repeats: int) -> dict[str, float]:
    """Median seconds of one call of each form, the forms alternating; each form is a list of calls
    (one per weight copy), timed together and divided."""
    for calls in forms.values():
        for call in calls:
            call()
    times = {name: [] for name in forms}
    for _ in range(repeats):
        for name, calls in forms.items():
            start = time.perf_counter()
            for call in calls:
                call()
            times[name].append((time.perf_counter() - start) / len(calls))
    return {name: percentile(samples, 50) for name, samples in times.items()}


def bench_config(num_experts: int, top_k: int, tokens_list: list[int], hidden: int, inter: int,
                 dtype: torch.dtype, repeats: int, bandwidth: float) -> list[dict]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    expert_bytes = 3 * hidden * inter * itemsize
    experts, (w13, w2) = hf_experts(num_experts, top_k, hidden, inter, dtype, seed=0)
    copies = max(1, -(-CYCLE_BYTES // (num_experts * expert_bytes)))
    hf_copies = [experts] + [copy.deepcopy(experts) for _ in range(copies - 1)]
    moe_weights = [(e.gate_up_proj.detach(), e.down_proj.detach()) for e in hf_copies]
    dense_copies = max(1, -(-CYCLE_BYTES // expert_bytes))
    generator = torch.Generator().manual_seed(1)
    dense_weights = [(make_linear((torch.randn(2 * inter, hidden, generator=generator) * 0.02).to(dtype), None),
                      make_linear((torch.randn(hidden, inter, generator=generator) * 0.02).to(dtype), None))
                     for _ in range(dense_copies)]
    results = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, generator=generator).to(dtype)
        logits = torch.randn(tokens, num_experts, generator=generator)
        weights, ids = pd_kernels.select_experts(logits, top_k, renormalize=True)
        weights = weights.to(dtype)
        dense_x = torch.randn(tokens * top_k, hidden, generator=generator).to(dtype)
        with torch.no_grad():
            ours = pd_kernels.fused_moe(x, w13, w2, ids, weights, backend="cpu")
            error = (ours.float() - reference.fused_moe(x, w13, w2, ids, weights).float()).abs().max().item()
            medians = timed({
                "ours": [lambda a=a, b=b: pd_kernels.fused_moe(x, a, b, ids, weights, backend="cpu")
                         for a, b in moe_weights],
                "hf": [lambda e=e: e(x, ids, weights) for e in hf_copies],
                "dense": [lambda a=a, b=b: b(reference.silu_and_mul(a(dense_x))) for a, b in dense_weights],
            }, repeats)
        touched = int(torch.unique(ids).numel())
        bound = touched * expert_bytes / bandwidth
        ours_s = medians["ours"]
        results.append({
            "experts": num_experts, "top_k": top_k, "tokens": tokens, "experts_touched": touched,
            "ours_ms": round(ours_s * 1e3, 3), "hf_ms": round(medians["hf"] * 1e3, 3),
            "dense_ms": round(medians["dense"] * 1e3, 3), "bound_ms": round(bound * 1e3, 3),
            "hf_over_ours": round(medians["hf"] / ours_s, 3), "dense_over_ours": round(medians["dense"] / ours_s, 3),
            "bound_over_ours": round(bound / ours_s, 3), "dense_over_bound": round(medians["dense"] / bound, 3),
            "max_abs_error": error,
        })
    return results


def bench(tokens: list[int], hidden: int, inter: int, threads: int, dtype: str, configs: list[tuple[int, int]],
          repeats: int) -> dict:
    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    pd_kernels.cpu.build()
    bandwidth = stream_bandwidth()
    results = [line for num_experts, top_k in configs
               for line in bench_config(num_experts, top_k, tokens, hidden, inter, torch_dtype, repeats, bandwidth)]
    return {
        "case": "fused_moe", "cpu": cpu_name(), "cpu_flags": cpu_flags(), "isa": pd_kernels.cpu.isa(),
        "threads": threads, "dtype": dtype, "hidden": hidden, "inter": inter, "repeats": repeats,
        "stream_gb_s": round(bandwidth / 1e9, 2), "results": results,
    }


def _config(text: str) -> tuple[int, int]:
    num_experts, top_k = (int(part) for part in text.split("x"))
    return num_experts, top_k


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 512])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--configs", type=_config, nargs="+", default=[(8, 2), (16, 4)],
                        help="EXPERTSxTOP_K, e.g. 8x2")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(json.dumps(bench(args.tokens, args.hidden, args.inter, args.threads, args.dtype, args.configs,
                           args.repeats)), flush=True)


if __name__ == "__main__":
    main()
