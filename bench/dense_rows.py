"""The few-row dense kernel against oneDNN's packed GEMM: ``python -m bench.dense_rows``.

``python -m bench.dense_rows [--model builtin:tiny-llama] [--threads 1,2] [--rows 1,2,4,8,16] [--repeats 31]``
builds one decode step's dense layers in the model's shapes (QKV, o_proj,
gate/up and down per layer, then the LM head; random weights, each layer
its own, so that they are read from memory as a step reads them, not from
the caches) and times both forms on them, alternating, for each thread and
row count. One JSON line each: medians in ms, oneDNN's time over ours, and
ours in GB/s of weights read against the copy bandwidth measured in the same
run at that thread count, the decode step's physical limit. A first version
of this comparison cycled through four distinct layers and found 3x at one
row: weights that fit in the caches say nothing about a decode step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.engine import measure_peaks
from pd.model.config import load_model_config
from pd.model.linear import make_linear
from pd.model.paths import resolve_model_path
from pd.workload.host import cpu_name
from pd.workload.stats import percentile


def step_shapes(model: str) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one step's dense layers, in the order a step runs them."""
    config = load_model_config(resolve_model_path(model))
    h, i = config.hidden_size, config.intermediate_size
    layer = [(config.q_size + 2 * config.kv_size, h), (h, config.q_size), (2 * i, h), (h, i)]
    return layer * config.num_layers + [(config.vocab_size, h)]


def time_step(layers: list, inputs: list[torch.Tensor], call) -> float:
    start = time.perf_counter()
    for layer, x in zip(layers, inputs):
        call(layer, x)
    return time.perf_counter() - start


def bench(model: str, threads: int, rows_list: list[int], repeats: int) -> list[dict]:
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    shapes = step_shapes(model)
    layers = [make_linear(torch.randn(out, inp, generator=generator), None, "onednn", few_rows=True)
              for out, inp in shapes]
    weight_bytes = sum(out * inp * 4 for out, inp in shapes)  # fp32; the panels' zero padding is not counted
    copy_bw = measure_peaks()[1]
    onednn = torch.ops.mkldnn._linear_pointwise.default
    forms = {
        "ours": lambda layer, x: layer.rows_kernel(x, layer.rows_weight, layer.bias, layer.out_features),
        "onednn": lambda layer, x: onednn(x, layer.weight, layer.bias, "none", [], ""),
    }
    results = []
    for rows in rows_list:
        inputs = [torch.randn(rows, inp, generator=generator) for _, inp in shapes]
        for call in forms.values():
            time_step(layers, inputs, call)  # oneDNN builds its kernel per shape
        times = {name: [] for name in forms}
        for _ in range(repeats):
            for name, call in forms.items():
                times[name].append(time_step(layers, inputs, call))
        ours, theirs = percentile(times["ours"], 50), percentile(times["onednn"], 50)
        results.append({
            "case": "dense_rows", "model": model, "threads": threads, "rows": rows,
            "weight_mib": round(weight_bytes / 2**20, 1), "ours_ms": round(ours * 1e3, 3),
            "onednn_ms": round(theirs * 1e3, 3), "onednn_over_ours": round(theirs / ours, 3),
            "ours_gb_s": round(weight_bytes / ours / 1e9, 2), "copy_gb_s": round(copy_bw / 1e9, 2),
            "ours_frac_of_copy": round(weight_bytes / ours / copy_bw, 3), "cpu": cpu_name(),
        })
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args(argv)
    for threads in (int(t) for t in args.threads.split(",")):
        for result in bench(args.model, threads, [int(r) for r in args.rows.split(",")], args.repeats):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
