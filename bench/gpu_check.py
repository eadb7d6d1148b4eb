"""The one prepared device check: ``make gpu-check``.

For a machine with CUDA torch, Triton and ``transformers`` but no Ray, no
NIXL and no package index. ``make gpu-deps`` (run where there is an index)
unpacks the one other package the engine imports, ``msgspec``, for that
machine's Python into ``.gpu-deps``; carry that folder along.

Runs four parts, each in its own process with its own time limit (ten
minutes in all), so that one failing part still leaves the others' figures:

1. ``kernels``: the Triton kernel tests compiled on the GPU
   (``PD_TEST_DEVICE=cuda``), fp32/fp16/bf16 against the torch reference,
   whose attention is SDPA, and FP8 KV pages (store bytes, attention);
2. ``bench.kernels``: decode attention against copy bandwidth (bf16 and
   FP8 pages), prefill
   against SDPA flash, the fused row-wise kernels against torch;
3. ``bench.gpu_engine``: a Llama-3-8B-shaped random model in bf16, our
   engine with and without CUDA graphs against HF ``generate`` at batch 32;
4. the same for 8 layers of a Qwen3-30B-A3B-shaped MoE (the fused MoE's
   Triton kernels inside the engine, captured in CUDA graphs).

Writes ``gpu_check.jsonl`` (one object per part: its exit code, seconds and
the JSON lines it printed) and each part's full log into ``--out``
(default ``$OUT``, else ``gpu-check/``), and prints the same objects.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/pd_kernels/test_triton_attention.py", "tests/pd_kernels/test_triton_rowwise.py",
                "tests/pd_kernels/test_triton_fp8_kv.py", "tests/pd_kernels/test_reference_attention.py",
                "tests/pd_kernels/test_fused_moe.py"]
PARTS = [
    ("kernels", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS], 180),
    ("bench_kernels", [sys.executable, "-m", "bench.kernels"], 90),
    ("gpu_engine", [sys.executable, "-m", "bench.gpu_engine"], 210),
    ("gpu_engine_moe", [sys.executable, "-m", "bench.gpu_engine", "--model", "qwen3-30b-a3b", "--layers", "8",
                        "--repeats", "2"], 120),
    ("step_syncs", [sys.executable, "-m", "bench.step_syncs"], 60),
]


def environment() -> dict[str, str]:
    env = dict(os.environ, PD_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    paths = [str(ROOT), str(ROOT / ".gpu-deps"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def run_part(name: str, command: list[str], timeout_s: int, out_dir: Path) -> dict:
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True,
                              timeout=timeout_s)
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        log = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    (out_dir / f"{name}.log").write_text(log)
    results = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                results.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    summary = log.strip().splitlines()[-1:] if log.strip() else []
    return {"part": name, "rc": rc, "seconds": round(time.monotonic() - started, 1), "results": results,
            "last_line": summary[0] if summary else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-check"))
    parser.add_argument("--parts", default=",".join(name for name, _, _ in PARTS))
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = set(args.parts.split(","))
    failed = False
    with open(out_dir / "gpu_check.jsonl", "w") as sink:
        for name, command, timeout_s in PARTS:
            if name not in wanted:
                continue
            record = run_part(name, command, timeout_s, out_dir)
            failed |= record["rc"] != 0
            line = json.dumps(record)
            sink.write(line + "\n")
            sink.flush()
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
