"""What bf16 weights cost on a host without native bf16: ``python -m bench.bf16_fallback``.

``python -m bench.bf16_fallback [--model builtin:smollm2-135m-instruct] [--threads 2] [--rows 1,8,256] [--repeats 9]``
builds one forward step's dense layers in the model's shapes (QKV, o_proj, gate/up and down per layer, then
the LM head; random weights, each layer its own, so they are read from memory as a step reads them) in the
forms an engine can hold them, and times each, alternating, per row count:

- ``fp32``: fp32 weights in oneDNN's packed form (what ``dtype: float32`` runs);
- ``bf16``: the form ``pd.model.linear`` picks for bf16 on this host: oneDNN's packed bf16 where oneDNN has
  native bf16 (AVX512-BW/VL/DQ or AVX-NE-CONVERT), else an fp32 copy of the weights (``compute_dtype``);
- ``matmul``, at one row only: a plain ``torch.matmul`` on the bf16 weights, the fallback not taken.

One JSON line per row count: medians in ms, ``bf16_over_fp32`` and ``matmul_over_fp32``. Run it
under ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 host to measure the AVX2
fallback there; the first line names the ISA in force.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from bench.dense_rows import step_shapes
from bench.engine import isa_info
from pd.model.linear import make_linear
from pd.workload.host import cpu_name
from pd.workload.stats import percentile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,256")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = step_shapes(args.model)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=generator) for out, inp in shapes]
    forms = {"fp32": [make_linear(w, None, "onednn") for w in weights],
             "bf16": [make_linear(w.bfloat16(), None, "onednn") for w in weights],
             "matmul": [make_linear(w.bfloat16(), None, "dense") for w in weights]}
    forms["matmul"] = [dataclasses.replace(layer, weight=layer.weight.bfloat16(), output_dtype=None)
                       if layer.output_dtype is not None else layer for layer in forms["matmul"]]
    del weights
    held = forms["bf16"][0].output_dtype is not None
    print(json.dumps({"case": "host", "cpu": cpu_name(), "threads": args.threads, "model": args.model,
                      "bf16_form": "fp32 copy" if held else "onednn bf16", **isa_info()}), flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {"fp32": [torch.randn(rows, inp, generator=generator) for _, inp in shapes]}
        inputs["bf16"] = inputs["matmul"] = [x.bfloat16() for x in inputs["fp32"]]
        timed = [form for form in forms if form != "matmul" or rows == 1]
        times: dict[str, list[float]] = {form: [] for form in timed}
        with torch.inference_mode():
            for repeat in range(args.repeats + 1):
                for form in timed:
                    start = time.perf_counter()
                    for layer, x in zip(forms[form], inputs[form]):
                        layer(x)
                    if repeat:  # the first pass builds oneDNN's kernels for the shapes
                        times[form].append(time.perf_counter() - start)
        median = {form: percentile(values, 50) for form, values in times.items()}
        row = {"case": "step", "rows": rows, **{f"{form}_ms": round(m * 1e3, 3) for form, m in median.items()},
               **{f"{form}_over_fp32": round(m / median["fp32"], 3) for form, m in median.items() if form != "fp32"},
               "repeats": args.repeats}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
