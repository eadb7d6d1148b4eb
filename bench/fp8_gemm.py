"""FP8 scaled products on the GPU: ours against ``torch._scaled_mm`` and bf16 cuBLAS, ``python -m bench.fp8_gemm``.

At a Llama-3-8B layer's four products (``layer_products``: N x K = 6144 x 4096 fused QKV, 4096 x 4096 o,
28672 x 4096 fused gate/up, 4096 x 14336 down) and M = 16 rows (a decode step) and 4096 (a prefill
chunk), times, as medians of ``triton.testing.do_bench``:

- ``ours``: ``pd_kernels.triton.scaled_mm``, e4m3 operands with per-token x per-channel scales (the
  engine's FP8 W8A8 product), bf16 out;
- ``ours_layer``: the same with the activations quantized first (``quantize_fp8_rows``), as
  ``pd.model.quant_linear.Fp8Linear`` runs a layer;
- ``torch_rowwise``: ``torch._scaled_mm`` on the same operands and scales (cuBLAS/CUTLASS row-wise);
- ``torch_tensorwise``: ``torch._scaled_mm`` with one scale per operand;
- ``bf16``: ``F.linear`` on the bf16 originals (cuBLAS).

Prints one JSON line per (product, M): each variant's ms and TFLOP/s (a variant this torch or GPU refuses
carries its error instead), ``ours``' ratios to the others (their time over ours: above 1, ours is faster),
and the relative error of ``ours`` and ``torch_rowwise`` against the fp32 product of the same FP8 operands.
Without CUDA it prints one line saying it was skipped.
"""

from __future__ import annotations

import json

import torch

from bench.random_models import SHAPES, ModelShape

ROWS = (16, 4096)
FP8 = torch.float8_e4m3fn
VARIANTS = ("ours", "ours_layer", "torch_rowwise", "torch_tensorwise", "bf16")


def layer_products(shape: ModelShape) -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of one dense layer's products, fused as the engine holds them."""
    hidden, inter = shape.hidden_size, shape.config["intermediate_size"]
    q_width, kv_width = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return [("qkv", q_width + 2 * kv_width, hidden), ("o", hidden, q_width), ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter)]


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def _median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def _tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as e4m3 with one absmax scale (fp32, one element)."""
    scale = (x.float().abs().max() / torch.finfo(FP8).max).clamp(min=1e-12).reshape(1)
    return (x.float() / scale).clamp(-torch.finfo(FP8).max, torch.finfo(FP8).max).to(FP8), scale


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / expected.abs().max()).item()


def fp8_layer(a: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """An FP8 W8A8 layer as ``Fp8Linear`` runs it: the activations quantized per token, then the product."""
    from pd_kernels.triton.scaled_mm import quantize_fp8_rows, scaled_mm

    a_q, a_scale = quantize_fp8_rows(a)
    return scaled_mm(a_q, w_q, a_scale, w_scale)


def bench_product(name: str, n: int, k: int, m: int) -> dict:
    import torch.nn.functional as F

    from pd_kernels.triton.scaled_mm import quantize_fp8_rows, scaled_mm

    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = (torch.randn(n, k, device="cuda", generator=generator) * k**-0.5).to(torch.bfloat16)
    a_q, a_scale = quantize_fp8_rows(a)
    w_q, w_scale = quantize_fp8_rows(w)
    a_t, a_t_scale = _tensorwise(a)
    w_t, w_t_scale = _tensorwise(w)
    calls = {
        "ours": lambda: scaled_mm(a_q, w_q, a_scale, w_scale),
        "ours_layer": lambda: fp8_layer(a, w_q, w_scale),
        "torch_rowwise": lambda: torch._scaled_mm(a_q, w_q.t(), scale_a=a_scale[:, None], scale_b=w_scale[None, :],
                                                  out_dtype=torch.bfloat16),
        "torch_tensorwise": lambda: torch._scaled_mm(a_t, w_t.t(), scale_a=a_t_scale, scale_b=w_t_scale,
                                                     out_dtype=torch.bfloat16),
        "bf16": lambda: F.linear(a, w),
    }
    record = {"case": "fp8_gemm", "product": name, "m": m, "n": n, "k": k}
    flops = gemm_flops(m, n, k)
    expected = (a_q.float() @ w_q.float().t()) * a_scale[:, None] * w_scale[None, :]
    for variant, call in calls.items():
        try:
            out = call()
            ms = _median_ms(call)
        except Exception as exc:  # noqa: BLE001 - a variant this torch or GPU refuses is its result
            record[f"{variant}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        record[f"{variant}_ms"] = ms
        record[f"{variant}_tflops"] = flops / ms / 1e9
        if variant in ("ours", "torch_rowwise"):
            record[f"{variant}_rel_err"] = _rel_err(out, expected)
    if "ours_ms" in record:
        for variant in VARIANTS[1:]:
            if f"{variant}_ms" in record:
                record[f"ours_vs_{variant}"] = record[f"{variant}_ms"] / record["ours_ms"]
    return record


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"case": "fp8_gemm", "skipped": "no CUDA device"}), flush=True)
        return
    device = torch.cuda.get_device_name()
    for name, n, k in layer_products(SHAPES["llama3-8b"]):
        for m in ROWS:
            try:
                record = bench_product(name, n, k, m)
            except Exception as exc:  # noqa: BLE001 - one product's failure is its line
                record = {"case": "fp8_gemm", "product": name, "m": m, "n": n, "k": k,
                          "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps({**record, "gpu": device}), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
