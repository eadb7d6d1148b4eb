"""The one prepared device check: ``make gpu-check``.

For a machine with CUDA torch, Triton and ``transformers`` but no Ray, no
NIXL and no package index. ``make gpu-deps`` (run where there is an index)
unpacks the one other package the engine imports, ``msgspec``, for that
machine's Python into ``.gpu-deps``; carry that folder along.

Each part runs in its own process with its own time limit, so that one
failing part still leaves the others' figures. Two phases:

1. Checks, side by side (nothing in them is timed, so they share the GPU):

   - ``kernels``: the Triton kernel tests compiled on the GPU
     (``PD_TEST_DEVICE=cuda``), fp32/fp16/bf16 against the torch reference,
     whose attention is SDPA, FP8 KV pages (store bytes, attention), and the
     multi-LoRA delta (a CUDA graph replay with it);
   - ``step_syncs``: a step's device-to-host syncs (``bench.step_syncs``);
   - ``random_models``: builds the random Llama-3-8B (32 layers) and
     Qwen3-30B-A3B (8 layers) checkpoints the timed parts share, into
     ``bench.random_models``' cache under ``/tmp/pd-gpu-check`` (a timed
     part builds what is missing itself);
   - ``fp32_dense``, ``fp32_moe``: ``bench.fp32_reference``, our bf16 engine
     and HF bf16 against HF fp32 on the same weights (Llama-3-8B shape, 8
     layers; Qwen3-30B-A3B shape, 4 layers), teacher-forced.

2. Benchmarks, one at a time:

   - ``bench_kernels``: ``bench.kernels``, decode attention against copy
     bandwidth (bf16 and FP8 pages), prefill against SDPA flash at head dims
     64/80/128 and 512/2048/8192 tokens, FP8 pages in prefill, the fused
     row-wise kernels against torch;
   - ``fp8_gemm``: ``bench.fp8_gemm``, our FP8 scaled product against
     ``torch._scaled_mm`` and bf16 cuBLAS at the 8B shape's four products;
   - ``lora_kernel``: ``bench.lora_kernel --device cuda``, the Triton
     multi-LoRA delta (4 adapters of rank 16, 32 and 256 rows, the 8B
     shape's o_proj and q|k|v, bf16): its max abs error against the torch
     reference, and its time over the base layer's GEMM;
   - ``gpu_engine``: ``bench.gpu_engine``, the 8B shape in bf16, our engine
     with and without CUDA graphs, and a second one with async scheduling
     (graphs), against HF ``generate`` at batch 32;
   - ``decode_roofline``: ``bench.decode_roofline``, our decode step at batch
     1/32/128/256, graphs and eager, against the bytes it must read over the
     copy bandwidth, and at batch 32 a verify step of 4 drafts a sequence
     (speculative decoding, graphs and eager) against the decode step; ``decode_roofline_async``: the same with async
     scheduling, graphs, at 32/128/256;
   - ``gpu_engine_moe``: ``bench.gpu_engine`` on 8 layers of the MoE shape.

The limits add up to eight minutes at most (the longest check, then every
benchmark's), and a part is given no more than what is left of that. Writes
into ``--out`` (default ``$OUT``, else ``gpu-check/``) ``gpu_check.jsonl``
(one object per part: its exit code, seconds, the JSON lines it printed and,
for pytest, its counts) and ``gpu_check.log`` (every part's output, each
under a header), and prints a line per part as it ends, then a summary of
the headline ratios (``bench.gpu_summary``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_summary import summary_lines

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/pd_kernels/test_triton_attention.py", "tests/pd_kernels/test_triton_rowwise.py",
                "tests/pd_kernels/test_triton_latent.py",
                "tests/pd_kernels/test_triton_fp8_kv.py", "tests/pd_kernels/test_reference_attention.py",
                "tests/pd_kernels/test_fused_moe.py", "tests/pd_kernels/test_triton_prefill.py",
                "tests/pd_kernels/test_lora.py"]
# The device's Python packages beyond the standard library, as import names (its image as read on
# 2026-11-17: device/KINDS.md), and what ``make gpu-deps`` carries there: every part must run on these
# alone (tests/bench/test_gpu_imports.py).
DEVICE_MODULES = (
    "absl", "accelerate", "aiohttp", "anyio", "attr", "attrs", "certifi", "charset_normalizer", "click",
    "cloudpickle", "cuda", "cupy", "einops", "filelock", "fsspec", "h11", "httpcore", "httpx", "huggingface_hub",
    "hf_xet", "hypothesis", "idna", "iniconfig", "jinja2", "markupsafe", "ml_dtypes", "mpmath", "msgpack",
    "networkx", "ninja", "numpy", "nvidia", "packaging", "pandas", "peft", "PIL", "pluggy", "prometheus_client", "psutil",
    "pygments", "pytest", "_pytest", "py", "xdist", "pytest_timeout", "yaml", "regex", "requests", "rich",
    "safetensors", "scipy", "sentencepiece", "sortedcontainers", "sympy", "tiktoken", "tokenizers", "torch",
    "torchgen", "functorch", "tqdm", "transformers", "triton", "typing_extensions", "urllib3", "xxhash", "zipp",
)
GPU_DEPS = ("msgspec",)
PROJECT_PACKAGES = ("pd", "pd_kernels", "bench", "tests", "transfer", "router", "sim")
TOTAL_LIMIT_S = 480
MIN_PART_S = 15  # a part given less than this is not started
LOG_KEEP_CHARS = 400_000  # of a part's output in gpu_check.log: its head and tail, the middle elided
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
PYTEST_SUMMARY = re.compile(r"^=*\s*(?:\d+ \w+)(?:, \d+ \w+)* in [\d.]+s")


@dataclass(frozen=True)
class Part:
    name: str
    args: list[str]  # after ``python``
    timeout_s: int


CHECKS = [
    Part("kernels", ["-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS], 100),
    Part("step_syncs", ["-m", "bench.step_syncs"], 100),
    Part("random_models", ["-m", "bench.random_models", "llama3-8b:32", "qwen3-30b-a3b:8"], 100),
    Part("fp32_dense", ["-m", "bench.fp32_reference", "--model", "llama3-8b", "--layers", "8"], 100),
    Part("fp32_moe", ["-m", "bench.fp32_reference", "--model", "qwen3-30b-a3b", "--layers", "4"], 100),
]
BENCHMARKS = [
    Part("bench_kernels", ["-m", "bench.kernels"], 55),
    Part("fp8_gemm", ["-m", "bench.fp8_gemm"], 25),
    Part("lora_kernel", ["-m", "bench.lora_kernel", "--device", "cuda"], 15),
    Part("gpu_engine", ["-m", "bench.gpu_engine", "--repeats", "2", "--async-scheduling"], 100),
    Part("decode_roofline", ["-m", "bench.decode_roofline", "--verify-k", "4", "--verify-batches", "32"], 75),
    Part("decode_roofline_async", ["-m", "bench.decode_roofline", "--async-scheduling", "--batches", "32,128,256",
                                   "--steps", "16"], 45),
    Part("gpu_engine_moe", ["-m", "bench.gpu_engine", "--model", "qwen3-30b-a3b", "--layers", "8", "--repeats", "2"],
         65),
]


def worst_case_s(checks: list[Part], benchmarks: list[Part]) -> int:
    """The longest the two phases can take: the slowest check, then every benchmark."""
    return max((p.timeout_s for p in checks), default=0) + sum(p.timeout_s for p in benchmarks)


def environment() -> dict[str, str]:
    env = dict(os.environ, PD_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    paths = [str(ROOT), str(ROOT / ".gpu-deps"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def pytest_counts(log: str) -> dict[str, int]:
    """The counts on pytest's last summary line (``10 failed, 89 passed, 15 skipped in 27.73s``); {} if none."""
    lines = [line for line in log.splitlines() if PYTEST_SUMMARY.match(line.strip())]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
            for n, kind in PYTEST_COUNTS.findall(lines[-1])}


def json_lines(log: str) -> list[dict]:
    results = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                results.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return results


def run_part(part: Part, timeout_s: float) -> tuple[dict, str]:
    """Run one part to its end or its limit: (its record, its output)."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *part.args], cwd=ROOT, env=environment(), capture_output=True,
                              text=True, timeout=timeout_s)
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        log = "".join(out.decode(errors="replace") if isinstance(out, bytes) else out
                      for out in (exc.stdout or b"", exc.stderr or b""))
    except OSError as exc:
        rc, log = "not started", f"{type(exc).__name__}: {exc}"
    record = {"part": part.name, "rc": rc, "seconds": round(time.monotonic() - started, 1),
              "limit_s": round(timeout_s), "results": json_lines(log)}
    counts = pytest_counts(log)
    if counts:
        record["pytest"] = counts
    return record, log


def clipped(log: str, keep: int = LOG_KEEP_CHARS) -> str:
    if len(log) <= keep:
        return log
    head = keep // 4
    return f"{log[:head]}\n[... {len(log) - keep} characters elided ...]\n{log[-(keep - head):]}"


class Sink:
    """The two files in the output folder, each record and log appended the moment its part ends."""

    def __init__(self, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "gpu_check.jsonl", "w")
        self.log = open(out_dir / "gpu_check.log", "w")
        self.records: list[dict] = []

    def add(self, record: dict, log: str) -> None:
        self.records.append(record)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        self.log.write(f"===== {record['part']}: rc {record['rc']}, {record['seconds']} s =====\n{clipped(log)}\n")
        self.log.flush()
        print(f"[{record['part']}] rc {record['rc']}, {record['seconds']} s, {len(record['results'])} results"
              + (f", {record['pytest']}" if "pytest" in record else ""), flush=True)

    def close(self) -> None:
        self.jsonl.close()
        self.log.close()


def run_checks(parts: list[Part], deadline: float, sink: Sink) -> None:
    """Every check at once, each to its own limit (none past the deadline)."""
    if not parts:
        return
    limit = min(max(p.timeout_s for p in parts), deadline - time.monotonic())
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
        futures = [pool.submit(run_part, part, min(part.timeout_s, limit)) for part in parts]
        for future in as_completed(futures):
            sink.add(*future.result())


def run_benchmarks(parts: list[Part], deadline: float, sink: Sink) -> None:
    for part in parts:
        left = deadline - time.monotonic()
        if left < MIN_PART_S:
            sink.add({"part": part.name, "rc": "not started", "seconds": 0.0, "results": [],
                      "reason": f"{left:.0f} s left of the check's {TOTAL_LIMIT_S} s"}, "")
            continue
        sink.add(*run_part(part, min(part.timeout_s, left)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-check"))
    parser.add_argument("--parts", default=",".join(p.name for p in CHECKS + BENCHMARKS))
    args = parser.parse_args()
    wanted = set(args.parts.split(","))
    deadline = time.monotonic() + TOTAL_LIMIT_S
    sink = Sink(Path(args.out))
    try:
        run_checks([p for p in CHECKS if p.name in wanted], deadline, sink)
        run_benchmarks([p for p in BENCHMARKS if p.name in wanted], deadline, sink)
    finally:
        sink.close()
    try:
        print("\n".join(summary_lines(sink.records)), flush=True)
    except Exception as exc:  # noqa: BLE001 - the records are written; a summary bug must not hide them
        print(f"summary failed: {type(exc).__name__}: {exc}", flush=True)
    return 1 if any(record["rc"] != 0 for record in sink.records) else 0


if __name__ == "__main__":
    sys.exit(main())
