"""``bench.gpu_summary``: the headline table from a run's records, whole or with parts missing."""

from __future__ import annotations

from bench.gpu_summary import summary_lines


def _records() -> list[dict]:
    prefill = [{"case": "prefill_attention", "head_dim": hd, "batch": b, "prompt_len": n, "tflops": 300.0,
                "speed_vs_sdpa_flash": 1.1} for hd in (64, 128) for b, n in ((32, 512), (2, 8192))]
    prefill.append({"case": "prefill_attention", "head_dim": 80, "batch": 32, "prompt_len": 512, "tflops": 200.0,
                    "sdpa_error": "RuntimeError: No available kernel"})
    return [
        {"part": "kernels", "rc": 1, "seconds": 40.0, "results": [], "pytest": {"failed": 2, "passed": 97}},
        {"part": "step_syncs", "rc": 0, "seconds": 20.0, "results": [
            {"workload": "decode", "mode": "sync", "syncs_per_step": 1.0, "ok": True},
            {"workload": "mixed", "mode": "async", "syncs_per_step": 2.0, "ok": False}]},
        {"part": "bench_kernels", "rc": 0, "seconds": 30.0, "results": [
            {"case": "device", "name": "NVIDIA H200"},
            {"case": "decode_attention", "fraction_of_copy": 0.96, "copy_gbps": 4248.2},
            {"case": "decode_attention_fp8", "speedup_vs_bf16_pages": 1.29},
            {"case": "prefill_attention_fp8", "error": "ValueError: x"}, *prefill]},
        {"part": "fp8_gemm", "rc": 0, "seconds": 10.0, "results": [
            {"case": "fp8_gemm", "product": "qkv", "m": 16, "ours_tflops": 90.0, "ours_vs_torch_rowwise": 0.8,
             "ours_vs_bf16": 1.5, "bf16_ms": 0.02, "ours_layer_ms": 0.01, "torch_tensorwise_error": "nope"}]},
        {"part": "decode_roofline", "rc": 0, "seconds": 40.0, "results": [
            {"case": "decode_roofline", "batch": 32, "mode": "graphs", "fraction_of_roofline": 0.87,
             "device_fraction": 0.9, "step_ms": 4.2},
            {"case": "decode_roofline", "batch": 32, "mode": "eager", "fraction_of_roofline": 0.3,
             "device_fraction": 0.31, "step_ms": 12.0},
            {"case": "decode_roofline", "batch": 256, "error": "OutOfMemoryError: CUDA"}]},
        {"part": "gpu_engine", "rc": 0, "seconds": 60.0, "results": [
            {"case": "gpu_engine", "model": "llama3-8b", "layers": 32, "batch": 32, "graphs_vs_hf": 3.77,
             "eager_vs_hf": 1.44, "graphs_vs_eager": 2.62}]},
        {"part": "fp32_dense", "rc": 0, "seconds": 30.0, "results": [
            {"case": "fp32_reference", "model": "llama3-8b", "layers": 8, "ours_over_hf_p50": 0.5,
             "ours_bf16": {"p50": 0.0785, "p99": 0.386, "top1_confident": 0.963},
             "hf_bf16": {"p50": 0.1564, "p99": 0.8739, "top1_confident": 0.892}}]},
    ]


def test_every_headline_shows():
    text = "\n".join(summary_lines(_records()))
    assert "NVIDIA H200" in text
    assert "kernel tests: 2 failed, 97 passed" in text
    assert "decode/sync 1.0" in text and "mixed/async 2.0 UNEXPECTED" in text
    assert "0.96 of copy" in text and "1.29x bf16 pages" in text
    assert "300 1.10x" in text and "200 no SDPA" in text
    assert "graphs 0.87 / 0.90 (4.2 ms)" in text and "eager 0.30" in text and "failed: OutOfMemoryError" in text
    assert "graphs 3.77x, eager 1.44x" in text
    assert "ours_bf16 0.0785 / 0.3860, 96.30%" in text and "hf_bf16 0.1564" in text
    qkv = next(line for line in text.splitlines() if line.strip().startswith("qkv"))
    assert qkv.split() == ["qkv", "16", "90", "0.80", "-", "1.50", "2.00"]


def test_missing_parts_print_dashes_not_errors():
    lines = summary_lines([{"part": "kernels", "rc": "timeout", "seconds": 100.0, "results": []}])
    text = "\n".join(lines)
    assert "unavailable" not in text
    assert "kernel tests: -" in text and "GPU unknown" in text


def test_a_malformed_record_costs_only_its_section():
    records = [{"part": "decode_roofline", "rc": 0, "seconds": 1.0, "results": [
        {"case": "decode_roofline", "batch": 1, "mode": "graphs", "fraction_of_roofline": "n/a"}]}]
    text = "\n".join(summary_lines(records))
    assert "roofline: unavailable (ValueError" in text and "fp32 equality" in text
