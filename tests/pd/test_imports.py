"""The engine imports and generates where Ray and NIXL are missing (a GPU box for `make gpu-check`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # a child Python, so that the import state is a fresh process's

SCRIPT = """
import sys
for missing in ("ray", "nixl", "nixl_cu12", "nixl_cu13"):
    sys.modules[missing] = None  # import of it now raises ImportError
from pd import LLM, SamplingParams
import pd_kernels
[out] = LLM("builtin:tiny-llama", num_blocks=64).generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
assert len(out.token_ids) == 2, out
print("ok")
"""


def test_the_engine_runs_without_ray_or_nixl():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
