"""On CPU the kernel tests run in Triton's interpreter: every kernel of ``pd_kernels.triton`` is interpreted.

A kernel decorated before ``TRITON_INTERPRET`` was set is a compiled
``JITFunction``, which fails on CPU tensors; that happens when collection
imports one before the variable is set (``tests/conftest.py`` sets it first).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import pd_kernels.triton
from tests.pd_kernels.conftest import DEVICE


def _kernels() -> dict[str, object]:
    found = {}
    for info in pkgutil.iter_modules(pd_kernels.triton.__path__):
        module = importlib.import_module(f"pd_kernels.triton.{info.name}")
        found.update({f"{module.__name__}.{name}": value for name, value in vars(module).items()
                      if isinstance(value, (JITFunction, InterpretedFunction))})
    return found


@pytest.mark.skipif(DEVICE != "cpu", reason="kernels are compiled on a GPU")
def test_every_triton_kernel_is_interpreted_on_cpu():
    kernels = _kernels()
    assert len(kernels) >= 5, sorted(kernels)
    compiled = sorted(name for name, kernel in kernels.items() if not isinstance(kernel, InterpretedFunction))
    assert not compiled, f"decorated before TRITON_INTERPRET was set: {compiled}"
