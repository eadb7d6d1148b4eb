"""What ``make gpu-check`` imports and runs exists on the device machine.

The device has CUDA torch, Triton, ``transformers`` and the packages its image
lists (``bench.gpu_check.DEVICE_MODULES``), plus what ``make gpu-deps`` carries
(``GPU_DEPS``), and nothing can be installed there. A part that imports
anything else fails on the device in its first second, which no CPU run
showed before: here every part's module is imported, and a tiny engine loads
and generates (synchronously and with async scheduling), in a process where
the project's own import of anything else fails.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from bench.gpu_check import BENCHMARKS, CHECKS, DEVICE_MODULES, GPU_DEPS, PROJECT_PACKAGES

pytestmark = pytest.mark.integration  # a process of its own

SCRIPT = textwrap.dedent("""
    import builtins, importlib, sys, tempfile
    from pathlib import Path
    ours = set(sys.argv[3].split(","))
    allowed = set(sys.argv[1].split(",")) | set(sys.stdlib_module_names) | ours
    real_import = builtins.__import__

    def device_import(name, globals=None, locals=None, fromlist=(), level=0):
        # Our code's imports only: a device package brings its own needs, in the device's versions.
        importer = (globals or {}).get("__name__") or ""
        if level == 0 and importer.partition(".")[0] in ours and name.partition(".")[0] not in allowed:
            raise ModuleNotFoundError(f"{importer} imports {name!r}, which the device machine lacks", name=name)
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = device_import
    for module in sys.argv[2].split(","):
        importlib.import_module(module)
    from tests.checkpoints import make_checkpoint
    from pd import LLM, SamplingParams
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint("llama", Path(tmp))
        for async_scheduling in (False, True):
            llm = LLM(str(path), dtype="float32", async_scheduling=async_scheduling, num_blocks=64)
            out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            assert len(out[0].token_ids) == 4
    print("ok")
""")


def _modules() -> list[str]:
    modules = ["pd.llm", "pd.engine.engine", "pd.sampling_params"]
    for part in CHECKS + BENCHMARKS:
        if part.args[:1] == ["-m"] and part.args[1] != "pytest":
            modules.append(part.args[1])
        modules += [arg.removesuffix(".py").replace("/", ".") for arg in part.args if arg.endswith(".py")]
    return modules


def test_every_part_imports_and_an_engine_runs_with_only_the_devices_packages():
    allowed = ",".join(sorted({*DEVICE_MODULES, *GPU_DEPS}))
    done = subprocess.run([sys.executable, "-c", SCRIPT, allowed, ",".join(_modules()), ",".join(PROJECT_PACKAGES)],
                          capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
