"""Drive vLLM's CPU engine (``bench/vllm_peer.py``, in the peer venv) from a benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.process import stop_process

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEER_PYTHON = ROOT / ".peer-venv" / "bin" / "python"


def cpu_list(threads: int) -> str:
    """The first ``threads`` cores this process may run on, as ``VLLM_CPU_OMP_THREADS_BIND`` spells them."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(core) for core in cores)


def peer_python(choice: str) -> Path | None:
    """The peer venv's python for ``--vllm`` (``auto``: the default venv when it exists)."""
    if choice == "off":
        return None
    if choice == "auto":
        return DEFAULT_PEER_PYTHON if DEFAULT_PEER_PYTHON.exists() else None
    return Path(choice)


class VllmPeer:
    """One vLLM engine in a subprocess, loaded once; ``run`` times one workload in it."""

    def __init__(self, python: Path, model_dir: Path, threads: int, dtype: str = "float32"):
        if not Path(python).exists():
            raise FileNotFoundError(f"no peer venv at {python}: run `make peer-venv` first")
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu_list(threads), VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads))
        env.pop("PYTHONPATH", None)
        self.process = subprocess.Popen(
            [str(python), str(ROOT / "bench" / "vllm_peer.py"), str(model_dir), dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env,
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"the vLLM peer did not start: {ready}")

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"the vLLM peer exited with code {code} (its log is above)")
        return json.loads(line)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        """(seconds, greedy token ids per prompt) for one ``generate`` call in the peer."""
        self.process.stdin.write(json.dumps({"cmd": "run", "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        return answer["elapsed_s"], answer["token_ids"]

    def close(self) -> None:
        """Ask the peer to quit; stop it if it does not within a minute."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                stop_process(self.process, timeout_s=10)
