"""``python -m pd_kernels.cpu``: build the C++ kernels for this host's ISA level, and for each level below it.

A lower build is what this host runs under ``ATEN_CPU_CAPABILITY`` (``avx2`` on an AVX-512 host,
``default``: ATen's scalar fallback): the tests of those paths use them, and a venv copied to a lower
host finds its build ready. Each compiles in a process of its own (torch fixes its capability at start),
the scalar one for minutes on 2 cores: here, not in the first test or engine start that needs it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pd_kernels.cpu

# The levels under each level, as ATEN_CPU_CAPABILITY names them.
LOWER = {"AVX512": ("avx2", "default"), "AVX2": ("default",), "DEFAULT": ()}

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pd_kernels.cpu.build()
    print(f"cpu kernels built for {pd_kernels.cpu.isa()}")
    if "--host-only" not in sys.argv:
        for capability in LOWER.get(pd_kernels.cpu.isa(), ()):
            env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
            subprocess.run([sys.executable, "-m", "pd_kernels.cpu", "--host-only"], env=env, check=True)
