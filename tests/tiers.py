"""Test tiers: what may run in ``make test-unit``, and the guard that makes a mislabelled test fail.

Two tiers, and a marker for what neither fast nor an integration test is:

- ``integration`` (a registered marker): a test that starts Ray, a Serve app or
  another process (worker subprocesses, a child pytest or Python, an S3 server,
  a peer process of a transfer). Mark a whole module with
  ``pytestmark = pytest.mark.integration``; a test that uses one of
  ``INTEGRATION_FIXTURES`` is marked by ``tests/conftest.py`` itself.
- ``slow`` (a registered marker): an in-process end-to-end check too heavy for
  the unit tier: a whole model through the Triton interpreter, a trained model
  against HF's reader, a benchmark's own run. ``make test`` runs it.
- unit: everything else, run by ``make test-unit`` in under two minutes on two
  cores, with no ports to share between concurrent runs.

With ``PD_TEST_TIER=unit`` (``make test-unit`` sets it) a test not marked
``integration`` that starts a Python process (a subprocess or a multiprocessing
one) or Ray fails at once with an error that names it; build tools such as
``ninja`` may run. ``refuse_processes`` wraps its setup, call and teardown (session
fixtures such as the Ray cluster are set up inside the first test that uses
them, so they are caught too). Without the variable nothing is patched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing.process
import os
import shlex
import shutil
import subprocess
import sys
from typing import Iterator

TIER_ENV = "PD_TEST_TIER"
UNIT = "unit"
INTEGRATION = "integration"
# Fixtures that start a Ray cluster and Serve apps (tests/serve/conftest.py): a test using one is integration.
INTEGRATION_FIXTURES = frozenset({"ray_cluster"})


class ProcessInUnitTier(RuntimeError):
    """A test of the unit tier started a process or Ray: it belongs to the integration tier."""


def unit_tier() -> bool:
    return os.environ.get(TIER_ENV) == UNIT


def _refusal(nodeid: str, what: str) -> ProcessInUnitTier:
    return ProcessInUnitTier(
        f"{nodeid} {what} in the unit tier ({TIER_ENV}={UNIT}): mark it @pytest.mark.{INTEGRATION} "
        f"(or its module: pytestmark = pytest.mark.{INTEGRATION}), or make it start nothing")


def _ray_dir() -> str | None:
    spec = importlib.util.find_spec("ray")  # found, not imported
    return next(iter(spec.submodule_search_locations), None) if spec and spec.submodule_search_locations else None


def starts_python_or_ray(args, executable) -> bool:
    """Whether a ``Popen`` would start a Python interpreter or one of Ray's binaries (raylet, gcs_server).

    Build tools are let through: torch's extension loader runs ``ninja`` (and a
    compiler when a C++ source changed) inside the first test that needs a kernel.
    """
    if executable is None:
        first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
        executable = shlex.split(os.fsdecode(first))[0] if isinstance(args, (str, bytes)) else first
    program = os.path.realpath(shutil.which(os.fsdecode(executable)) or os.fsdecode(executable))
    ray_dir = _ray_dir()
    return (os.path.basename(program).startswith("python") or program == os.path.realpath(sys.executable)
            or (ray_dir is not None and program.startswith(os.path.realpath(ray_dir) + os.sep)))


@contextlib.contextmanager
def refuse_processes(nodeid: str) -> Iterator[None]:
    """While open, starting a Python or Ray process, or a multiprocessing one, raises ``ProcessInUnitTier``.

    Patched at the lowest common points: ``Popen._execute_child`` (``subprocess.run``,
    ``Popen`` however imported, asyncio's subprocesses, Ray's own node processes)
    and ``BaseProcess.start`` (every multiprocessing context, process pools).
    ``ray.init`` is refused by name once ``ray`` is imported, for a clearer message
    than the process it would start.
    """
    execute_child = subprocess.Popen._execute_child

    def guarded_execute_child(self, args, executable, *rest, **kwargs):
        if starts_python_or_ray(args, executable):
            raise _refusal(nodeid, f"starts a subprocess ({args!r:.120})")
        return execute_child(self, args, executable, *rest, **kwargs)

    def refuse(what: str):
        def raise_(*args, **kwargs):
            raise _refusal(nodeid, what)
        return raise_

    patches = [(subprocess.Popen, "_execute_child", guarded_execute_child),
               (multiprocessing.process.BaseProcess, "start", refuse("starts a multiprocessing process"))]
    ray = sys.modules.get("ray")
    if ray is not None and hasattr(ray, "init"):
        patches.append((ray, "init", refuse("calls ray.init")))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
