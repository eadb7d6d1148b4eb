"""The headline ratios of a ``make gpu-check`` run, as a short table for a human.

``summary_lines(records)`` takes ``bench.gpu_check``'s records (one a part: ``part``, ``rc``, ``seconds``,
``results``, and ``pytest`` counts for the kernel tests) and returns the lines to print last, where a reply
that keeps only the output's tail still shows them. A missing part or field prints as ``-``, and a section
that cannot be built says so in its own line: the JSON records are the full figures either way.
"""

from __future__ import annotations

from typing import Callable, Iterable

MISSING = "-"


def _num(value, spec: str = ".2f", suffix: str = "") -> str:
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def _results(records: list[dict], part: str) -> list[dict]:
    return next((r.get("results", []) for r in records if r.get("part") == part), [])


def _cases(records: list[dict], part: str, case: str) -> list[dict]:
    return [r for r in _results(records, part) if r.get("case") == case]


def _first(rows: Iterable[dict], **match) -> dict:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), {})


def parts_table(records: list[dict]) -> list[str]:
    lines = [f"{'part':<16} {'rc':>11} {'seconds':>8} {'results':>8} {'errors':>7}"]
    for record in records:
        errors = sum("error" in r or any(k.endswith("_error") for k in r) for r in record.get("results", []))
        lines.append(f"{record.get('part', '?'):<16} {str(record.get('rc')):>11} {_num(record.get('seconds'), '.1f'):>8} "
                     f"{len(record.get('results', [])):>8} {errors:>7}")
    return lines


def checks(records: list[dict]) -> list[str]:
    counts = next((r.get("pytest") for r in records if r.get("part") == "kernels"), None)
    lines = ["kernel tests: " + (", ".join(f"{n} {kind}" for kind, n in counts.items()) if counts else MISSING)]
    syncs = [f"{r.get('workload')}/{r.get('mode')} {r.get('syncs_per_step')}{'' if r.get('ok') else ' UNEXPECTED'}"
             for r in _results(records, "step_syncs") if "workload" in r]
    lines.append("step syncs per step: " + (", ".join(syncs) or MISSING))
    return lines


def attention(records: list[dict]) -> list[str]:
    rows = _results(records, "bench_kernels")
    decode, fp8 = _first(rows, case="decode_attention"), _first(rows, case="decode_attention_fp8")
    few, prefill_fp8 = _first(rows, case="decode_attention_few_seqs"), _first(rows, case="prefill_attention_fp8")
    lines = [f"decode attention 64x4096: bf16 pages {_num(decode.get('fraction_of_copy'))} of copy "
             f"({_num(decode.get('copy_gbps'), '.0f')} GB/s); FP8 pages "
             f"{_num(fp8.get('speedup_vs_bf16_pages'), '.2f', 'x')} bf16 pages; 4x32K split-KV "
             f"{_num(few.get('speedup_vs_single_pass'), '.2f', 'x')} single pass",
             f"prefill 8x2048 FP8 pages: {_num(prefill_fp8.get('speedup_vs_bf16_pages'), '.2f', 'x')} bf16 pages",
             "prefill ours/SDPA flash (ours TFLOP/s, ratio), causal, heads 32/8:"]
    grid = [r for r in rows if r.get("case") == "prefill_attention"]
    shapes = sorted({(r.get("batch"), r.get("prompt_len")) for r in grid}, key=lambda s: (s[1] or 0))
    lines.append("  hd  " + "".join(f"{f'{b}x{n}':>18}" for b, n in shapes))
    for head_dim in sorted({r.get("head_dim") for r in grid if r.get("head_dim") is not None}):
        cells = []
        for batch, prompt_len in shapes:
            r = _first(grid, head_dim=head_dim, batch=batch, prompt_len=prompt_len)
            if "error" in r:
                cells.append("ours failed")
            elif "sdpa_error" in r:
                cells.append(f"{_num(r.get('tflops'), '.0f')} no SDPA")
            else:
                cells.append(f"{_num(r.get('tflops'), '.0f')} {_num(r.get('speed_vs_sdpa_flash'), '.2f', 'x')}")
        lines.append(f"  {head_dim:<4}" + "".join(f"{c:>18}" for c in cells))
    return lines


def gemm(records: list[dict]) -> list[str]:
    lines = ["FP8 GEMM (ours TFLOP/s; ours' speed over torch rowwise, tensorwise, bf16; ours as a layer over bf16):",
             f"  {'product':<9}{'M':>6}{'ours':>8}{'rowwise':>9}{'tensor':>8}{'bf16':>7}{'layer/bf16':>11}"]
    for r in _cases(records, "fp8_gemm", "fp8_gemm"):
        layer_vs_bf16 = (r["bf16_ms"] / r["ours_layer_ms"]) if "bf16_ms" in r and "ours_layer_ms" in r else None
        lines.append(f"  {r.get('product', '?'):<9}{r.get('m', 0):>6}{_num(r.get('ours_tflops'), '.0f'):>8}"
                     f"{_num(r.get('ours_vs_torch_rowwise')):>9}{_num(r.get('ours_vs_torch_tensorwise')):>8}"
                     f"{_num(r.get('ours_vs_bf16')):>7}{_num(layer_vs_bf16):>11}")
    return lines


def roofline(records: list[dict]) -> list[str]:
    rows = _cases(records, "decode_roofline", "decode_roofline") + _cases(records, "decode_roofline_async",
                                                                          "decode_roofline")
    lines = ["decode step / roofline, 8B shape (fraction of roofline by step wall, by device time; step ms):"]
    for batch in sorted({r.get("batch") for r in rows if r.get("batch") is not None}):
        cells = []
        for mode in ("graphs", "eager", "graphs_async"):
            r = _first(rows, batch=batch, mode=mode)
            if mode == "graphs_async" and not r:
                continue
            cells.append(f"{mode} {_num(r.get('fraction_of_roofline'))} / {_num(r.get('device_fraction'))} "
                         f"({_num(r.get('step_ms'), '.1f')} ms)")
        error = _first(rows, batch=batch).get("error")
        lines.append(f"  batch {batch:<4} " + (f"failed: {error[:80]}" if error else "   ".join(cells)))
    return lines


def engine_vs_hf(records: list[dict]) -> list[str]:
    lines = []
    for part in ("gpu_engine", "gpu_engine_moe"):
        r = _first(_results(records, part), case="gpu_engine")
        lines.append(f"ours/HF generate, {r.get('model', part)} {r.get('layers', '')} layers, batch "
                     f"{r.get('batch', '')}: graphs {_num(r.get('graphs_vs_hf'), '.2f', 'x')}, eager "
                     f"{_num(r.get('eager_vs_hf'), '.2f', 'x')} (graphs/eager {_num(r.get('graphs_vs_eager'))})"
                     + (f", graphs+async {_num(r.get('graphs_async_vs_hf'), '.2f', 'x')} (same tokens: "
                        f"{r.get('agree_async')})" if "graphs_async_vs_hf" in r else "")
                     + (f", async failed: {r['graphs_async_error'][:80]}" if "graphs_async_error" in r else ""))
    return lines


def equality(records: list[dict]) -> list[str]:
    lines = ["fp32 equality, teacher-forced |delta log p| p50 / p99, top-1 at confident positions:"]
    for part in ("fp32_dense", "fp32_moe"):
        r = _first(_results(records, part), case="fp32_reference")
        cells = []
        for who in ("ours_bf16", "hf_bf16"):
            s = r.get(who, {})
            cells.append(f"{who} {_num(s.get('p50'), '.4f')} / {_num(s.get('p99'), '.4f')}, "
                         f"{_num(s.get('top1_confident'), '.2%')}")
        lines.append(f"  {r.get('model', part)} {r.get('layers', '')}L: " + "; ".join(cells)
                     + f"; ours/HF p50 {_num(r.get('ours_over_hf_p50'))}")
    return lines


SECTIONS: list[tuple[str, Callable[[list[dict]], list[str]]]] = [
    ("parts", parts_table), ("checks", checks), ("attention", attention), ("fp8 gemm", gemm),
    ("roofline", roofline), ("engine vs HF", engine_vs_hf), ("fp32 equality", equality),
]


def summary_lines(records: list[dict]) -> list[str]:
    gpu = next((r.get("name") for r in _results(records, "bench_kernels") if r.get("case") == "device"), None)
    lines = ["", f"===== gpu-check summary ({gpu or 'GPU unknown'}) ====="]
    for name, section in SECTIONS:
        try:
            lines += section(records)
        except Exception as exc:  # noqa: BLE001 - one section's surprise must not hide the others
            lines.append(f"{name}: unavailable ({type(exc).__name__}: {exc})")
    return lines
