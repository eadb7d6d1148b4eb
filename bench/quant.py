"""8-bit dense layers against fp32 on CPU, in one run: ``python -m bench.quant``.

``python -m bench.quant [--model builtin:smollm2-135m-instruct] [--rows 1 8 64 512] [--repeats 7] [--threads N]``

Builds one forward pass's dense layers in the model's shapes (per layer: fused QKV, o_proj, fused
gate/up and down; random weights, each layer its own, so that they are read from memory as a step
reads them) in four forms and times them, alternating, at each row count (tokens in the step):

- ``fp32``: ``F.linear`` on the fp32 weights, the plain peer;
- ``engine_fp32``: the unquantized engine's own layers on the cpu backend (``pd.model.linear.make_linear``:
  oneDNN-packed, and the few-row kernel up to 8 rows);
- ``int8``: W8A8 INT8 as the cpu backend runs it (``pd.model.quant_linear.Int8Linear``: per-token int8
  activations and the output's scaling in ``pd_kernels/cpu/int8.cpp``; the GEMM ``torch._int_mm`` on a CPU
  with AVX512-VNNI, else the extension's ``int8_gemm``);
- ``int8_aten``: ``pd_kernels.int8`` without the extension: the passes around the GEMM as aten ops, and the GEMM
  ``torch._int_mm`` on every host (a plain loop without AVX512-VNNI);
- ``fp8``: an FP8 checkpoint's layers as a CPU runs them (``make_quantized_linear``: dequantized at load).

One JSON object per row count: medians in ms, each form's speed-up over ``fp32`` and ``engine_fp32``,
the weights' bytes of each form, the time to dequantize the FP8 weights at load, the CPU's name, its
ISA flags and the int8 dot-product extensions it has (VNNI, AMX), and torch's CPU capability.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import pd_kernels.cpu
from pd.model.config import load_model_config
from pd.model.linear import make_linear
from pd.model.paths import resolve_model_path
from pd.model.quant_linear import make_quantized_linear
from pd.model.quant_scheme import WeightFormat
from pd.model.quant_weights import quantize
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile

# The int8 dot-product instructions oneDNN's s8s8s32 GEMM takes where present.
INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "avx_vnni_int8"})


def int8_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(INT8_FLAGS & set(flags))


def layer_shapes(model: str) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one forward pass's quantized layers, in the order it runs them."""
    config = load_model_config(resolve_model_path(model))
    h, i = config.hidden_size, config.intermediate_size
    return [(config.q_size + 2 * config.kv_size, h), (h, config.q_size), (2 * i, h), (h, i)] * config.num_layers


def build(shapes: list[tuple[int, int]]) -> tuple[dict[str, list], dict[str, int], float]:
    """Each form's layers, each form's weight bytes, and the seconds the FP8 layers took to dequantize."""
    generator = torch.Generator().manual_seed(0)
    forms: dict[str, list] = {"fp32": [], "engine_fp32": [], "int8": [], "int8_aten": [], "fp8": []}
    sizes = dict.fromkeys(forms, 0)
    dequantizing = 0.0
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
        forms["fp32"].append(weight)
        forms["engine_fp32"].append(make_linear(weight, None, "onednn", few_rows=True))
        q8 = quantize(weight, WeightFormat.INT8_CHANNEL)
        forms["int8"].append(make_quantized_linear(q8, None, torch.float32, "onednn", few_rows=True))
        forms["int8_aten"].append(make_quantized_linear(q8, None, torch.float32, "onednn", few_rows=False))
        fp8 = quantize(weight, WeightFormat.FP8_CHANNEL)
        started = time.perf_counter()
        forms["fp8"].append(make_quantized_linear(fp8, None, torch.float32, "onednn", few_rows=True))
        dequantizing += time.perf_counter() - started
        sizes["fp32"] += weight.numel() * 4
        sizes["engine_fp32"] += weight.numel() * 4
        sizes["int8"] += q8.num_bytes
        sizes["int8_aten"] += q8.num_bytes
        sizes["fp8"] += weight.numel() * 4  # held dequantized; the checkpoint's FP8 bytes are fp8.num_bytes
    return forms, sizes, dequantizing


def call(form: str):
    if form == "fp32":
        return lambda layer, x: F.linear(x, layer)
    return lambda layer, x: layer(x)


def time_pass(layers: list, inputs: list[torch.Tensor], run) -> float:
    started = time.perf_counter()
    for layer, x in zip(layers, inputs):
        run(layer, x)
    return time.perf_counter() - started


def bench(model: str, rows_list: list[int], repeats: int) -> list[dict]:
    shapes = layer_shapes(model)
    pd_kernels.cpu.build()
    forms, sizes, dequantizing = build(shapes)
    results = []
    for rows in rows_list:
        by_width = {k: torch.randn(rows, k) for k in {in_features for _, in_features in shapes}}
        inputs = [by_width[in_features] for _, in_features in shapes]
        for form, layers in forms.items():
            time_pass(layers, inputs, call(form))  # oneDNN builds its kernels per shape
        times: dict[str, list[float]] = {form: [] for form in forms}
        for _ in range(repeats):
            for form, layers in forms.items():
                times[form].append(time_pass(layers, inputs, call(form)))
        medians = {form: percentile(t, 50) for form, t in times.items()}
        results.append({
            "case": "quant_dense_layers", "model": model, "rows": rows, "layers": len(shapes),
            "threads": torch.get_num_threads(), **{f"{form}_ms": round(m * 1e3, 3) for form, m in medians.items()},
            "int8_speedup_over_fp32": round(medians["fp32"] / medians["int8"], 3),
            "int8_speedup_over_engine_fp32": round(medians["engine_fp32"] / medians["int8"], 3),
            "int8_aten_speedup_over_fp32": round(medians["fp32"] / medians["int8_aten"], 3),
            "fp8_speedup_over_engine_fp32": round(medians["engine_fp32"] / medians["fp8"], 3),
            **{f"{form}_weight_mib": round(size / 2**20, 1) for form, size in sizes.items()
               if form in ("fp32", "int8", "fp8")},
            "fp8_dequantize_at_load_s": round(dequantizing, 3),
            "cpu": cpu_name(), "cpu_flags": cpu_flags(), "int8_flags": int8_flags(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        })
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for result in bench(args.model, args.rows, args.repeats):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
