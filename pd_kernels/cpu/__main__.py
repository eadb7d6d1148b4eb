"""``python -m pd_kernels.cpu``: build the C++ kernels for this host's ISA level, and for AVX2 below it.

The AVX2 build is what an AVX-512 host runs under ``ATEN_CPU_CAPABILITY=avx2``: the tests of the AVX2
path use it, and a venv copied to an AVX2-only host finds it ready.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pd_kernels.cpu

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pd_kernels.cpu.build()
    print(f"cpu kernels built for {pd_kernels.cpu.isa()}")
    if pd_kernels.cpu.isa() == "AVX512" and "--host-only" not in sys.argv:
        # torch fixes its capability at start, so the lower level builds in a process of its own.
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
        subprocess.run([sys.executable, "-m", "pd_kernels.cpu", "--host-only"], env=env, check=True)
