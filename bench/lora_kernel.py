"""The multi-LoRA delta against the base layer's own GEMM: ``python -m bench.lora_kernel``.

``python -m bench.lora_kernel [--device cpu|cuda] [--threads N] [--repeats 201]``

On CPU (the default), at SmolLM2-135M's layers (hidden 576, intermediate 1536: q|k|v 576 -> 576 + 192 +
192, o_proj, gate|up 576 -> 2 x 1536, down), adapters of rank 16 in 8 slots: a decode batch of 32 rows
over 4 of them (scattered, as the engine orders rows by request), and 32 rows with none. Each line times,
alternating, medians:

- ``cpu``: ``pd_kernels.lora_delta(backend="cpu")``, the public entry point with its checks (fp32: C++);
- ``reference``: the same call with ``backend="torch"``;
- ``linear``: ``torch.nn.functional.linear`` of the same rows by the base layer's weight, the product the
  delta rides on;

and prints ``cpu_over_linear`` (what an adapter adds to the layer's time), ``reference_over_cpu`` and the
max abs difference of the two deltas. A first line names the host: its CPU, the ISA level the C++ kernels
were built for, its flags, the threads.

With ``--device cuda`` (``make gpu-check``), at Llama-3-8B's o_proj (4096 -> 4096, one slice) and q|k|v
(4096 -> 6144, three slices) in bf16, 32 and 256 rows over 4 adapters of rank 16: the Triton kernels'
max abs error against the torch reference, and their time against the base layer's bf16 GEMM (cuBLAS),
medians of ``triton.testing.do_bench``: launched eagerly (``lora_over_linear``: the delta's host-side checks
and two launches included) and replayed from CUDA graphs, as a decode step runs them
(``lora_over_linear_graphed``: the device's time alone). Without CUDA it prints one line saying it was
skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import pd_kernels
from pd_kernels import NO_LORA

RANK = 16


@dataclass(frozen=True)
class LoraLayer:
    name: str
    in_features: int
    slice_starts: tuple[int, ...]
    out_features: int


# SmolLM2-135M: 9 query heads and 3 KV heads of 64.
SMOLLM2_LAYERS = (LoraLayer("qkv", 576, (0, 576, 768), 960), LoraLayer("o_proj", 576, (0,), 576),
                  LoraLayer("gate_up", 576, (0, 1536), 3072), LoraLayer("down", 1536, (0,), 576))
# Llama-3-8B: 32 query heads and 8 KV heads of 128.
LLAMA3_8B_LAYERS = (LoraLayer("o_proj", 4096, (0,), 4096), LoraLayer("qkv", 4096, (0, 4096, 5120), 6144))


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def scattered_slots(num_rows: int, num_adapters: int, seed: int = 0) -> list[int]:
    """Each row's slot, ``num_adapters`` of them spread over the batch in no order (every one present)."""
    generator = torch.Generator().manual_seed(seed)
    slots = [n % num_adapters for n in range(num_rows)]
    return [slots[i] for i in torch.randperm(num_rows, generator=generator).tolist()]


def layer_inputs(layer: LoraLayer, row_slots: list[int], num_slots: int, dtype: torch.dtype,
                 device: str) -> dict:
    """One layer's base weight and a batch's ``lora_delta`` arguments, random; B small, so that repeated
    calls adding into ``out`` stay finite."""
    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    rows, width = len(row_slots), len(layer.slice_starts) * RANK
    return {
        "weight": randn(layer.out_features, layer.in_features, scale=layer.in_features ** -0.5),
        "out": randn(rows, layer.out_features, scale=1.0), "x": randn(rows, layer.in_features, scale=1.0),
        "lora_a": randn(num_slots, width, layer.in_features, scale=layer.in_features ** -0.5),
        "lora_b": randn(num_slots, layer.out_features, RANK, scale=1e-3),
        "row_slots": torch.tensor(row_slots, dtype=torch.int32, device=device),
        "slice_starts": layer.slice_starts,
    }


def delta(args: dict, backend: str) -> torch.Tensor:
    """The delta ``backend`` adds to a copy of ``out`` (fp32)."""
    out = args["out"].clone()
    pd_kernels.lora_delta(out, args["x"], args["lora_a"], args["lora_b"], args["row_slots"], args["slice_starts"],
                          backend=backend)
    return out.float() - args["out"].float()


def cpu_host_line(threads: int) -> dict:
    import pd_kernels.cpu
    from pd.workload.host import cpu_flags, cpu_name

    return {"case": "host", "cpu": cpu_name(), "isa": pd_kernels.cpu.isa(), "cpu_flags": cpu_flags(),
            "threads": threads}


def bench_cpu_layer(layer: LoraLayer, batch: str, row_slots: list[int], repeats: int) -> dict:
    from pd.workload.stats import percentile

    args = layer_inputs(layer, row_slots, 8, torch.float32, "cpu")
    lora_args = [args[name] for name in ("out", "x", "lora_a", "lora_b", "row_slots", "slice_starts")]
    forms = {
        "cpu": lambda: pd_kernels.lora_delta(*lora_args, backend="cpu"),
        "reference": lambda: pd_kernels.lora_delta(*lora_args, backend="torch"),
        "linear": lambda: F.linear(args["x"], args["weight"]),
    }
    error = float((delta(args, "cpu") - delta(args, "torch")).abs().max())
    for call in forms.values():
        call()
    times = {name: [] for name in forms}
    for _ in range(repeats):
        for name, call in forms.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    cpu, ref, linear = (percentile(times[name], 50) for name in forms)
    return {"case": "lora_cpu", "layer": layer.name, "batch": batch, "rows": len(row_slots),
            "adapters": len({s for s in row_slots if s != NO_LORA}), "in_features": layer.in_features,
            "out_features": layer.out_features, "slices": len(layer.slice_starts), "rank": RANK,
            "cpu_us": round(cpu * 1e6, 1), "reference_us": round(ref * 1e6, 1), "linear_us": round(linear * 1e6, 1),
            "cpu_over_linear": round(cpu / linear, 3), "reference_over_cpu": round(ref / cpu, 2),
            "max_abs_diff": error}


def bench_cpu(threads: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    _emit(**cpu_host_line(threads))
    batches = {"4_adapters": scattered_slots(32, 4), "no_adapter": [NO_LORA] * 32}
    for batch, row_slots in batches.items():
        for layer in SMOLLM2_LAYERS:
            _emit(**bench_cpu_layer(layer, batch, row_slots, repeats))


def bench_cuda_layer(layer: LoraLayer, num_rows: int) -> dict:
    import triton.testing

    args = layer_inputs(layer, scattered_slots(num_rows, 4), 4, torch.bfloat16, "cuda")
    error = float((delta(args, "triton") - delta(args, "torch")).abs().max())
    lora_args = [args[name] for name in ("out", "x", "lora_a", "lora_b", "row_slots", "slice_starts")]

    def median_ms(fn) -> float:
        return triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median")

    def graphed(fn):
        """``fn`` captured in a CUDA graph, as a decode step replays it: the device's time, no launch costs."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    forms = {"lora": lambda: pd_kernels.lora_delta(*lora_args, backend="triton"),
             "linear": lambda: F.linear(args["x"], args["weight"])}
    eager = {name: median_ms(fn) for name, fn in forms.items()}
    graph = {name: median_ms(graphed(fn)) for name, fn in forms.items()}
    return {"case": "lora_cuda", "layer": layer.name, "rows": num_rows, "adapters": 4, "rank": RANK,
            "in_features": layer.in_features, "out_features": layer.out_features, "dtype": "bf16",
            "max_abs_err": error, "lora_ms": round(eager["lora"], 4), "linear_ms": round(eager["linear"], 4),
            "lora_over_linear": round(eager["lora"] / eager["linear"], 3),
            "lora_graph_ms": round(graph["lora"], 4), "linear_graph_ms": round(graph["linear"], 4),
            "lora_over_linear_graphed": round(graph["lora"] / graph["linear"], 3)}


def bench_cuda() -> None:
    if not torch.cuda.is_available():
        _emit(case="skipped", reason="no CUDA device")
        return
    _emit(case="device", name=torch.cuda.get_device_name())
    for layer in LLAMA3_8B_LAYERS:
        for num_rows in (32, 256):
            try:
                _emit(**bench_cuda_layer(layer, num_rows))
            except Exception as exc:  # noqa: BLE001 - a case's failure is its result; the next still runs
                _emit(case="lora_cuda", layer=layer.name, rows=num_rows, error=f"{type(exc).__name__}: {exc}"[:500])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads (cpu only)")
    parser.add_argument("--repeats", type=int, default=201, help="timed calls of each form (cpu only)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        bench_cuda()
    else:
        bench_cpu(args.threads, args.repeats)


if __name__ == "__main__":
    main()
