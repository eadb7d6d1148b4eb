"""Stopping a child process that a benchmark or a sweep started."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen, timeout_s: float) -> None:
    """Terminate ``process`` if it still runs, wait up to ``timeout_s``, then kill it; always reaps it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
