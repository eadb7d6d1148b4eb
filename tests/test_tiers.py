"""The unit tier's guard (``tests/tiers.py``): it refuses a process or Ray, names the test, and restores all."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import types

import pytest

from tests import tiers

NODE = "tests/pd/test_example.py::test_unmarked"


def test_a_python_subprocess_is_refused_naming_the_test():
    with tiers.refuse_processes(NODE), pytest.raises(tiers.ProcessInUnitTier) as refused:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert NODE in str(refused.value) and "pytest.mark.integration" in str(refused.value)


def test_a_multiprocessing_process_is_refused():
    process = multiprocessing.get_context("spawn").Process(target=print)
    with tiers.refuse_processes(NODE), pytest.raises(tiers.ProcessInUnitTier, match="multiprocessing"):
        process.start()


def test_ray_init_is_refused_once_ray_is_imported(monkeypatch):
    started = []
    fake_ray = types.SimpleNamespace(init=lambda *args, **kwargs: started.append(args))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    with tiers.refuse_processes(NODE), pytest.raises(tiers.ProcessInUnitTier, match="ray.init"):
        sys.modules["ray"].init()
    sys.modules["ray"].init()  # restored
    assert started == [()]


def test_build_tools_pass_and_python_or_ray_binaries_do_not():
    assert not tiers.starts_python_or_ray(["ninja", "--version"], None)
    assert not tiers.starts_python_or_ray("c++ -O2 a.cpp", None)
    assert tiers.starts_python_or_ray([sys.executable, "-m", "locust"], None)
    assert tiers.starts_python_or_ray("python3 -c pass", None)
    assert tiers.starts_python_or_ray(["/bin/sh", "-c", "x"], sys.executable)
    ray_dir = tiers._ray_dir()
    if ray_dir is not None:
        assert tiers.starts_python_or_ray([f"{ray_dir}/core/src/ray/raylet/raylet"], None)


def test_everything_is_restored_after():
    originals = (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start)
    with pytest.raises(RuntimeError), tiers.refuse_processes(NODE):
        raise RuntimeError("a failing test")
    assert (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start) == originals


def test_the_unit_tier_is_only_on_when_asked(monkeypatch):
    monkeypatch.delenv(tiers.TIER_ENV, raising=False)
    assert not tiers.unit_tier()
    monkeypatch.setenv(tiers.TIER_ENV, tiers.UNIT)
    assert tiers.unit_tier()
