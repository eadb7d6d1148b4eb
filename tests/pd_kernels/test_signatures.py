"""Every backend's kernel takes the arguments of the public entry point, in its order.

``pd_kernels.__init__`` spells each entry point's signature out once, one
argument a line; the twins in ``pd_kernels.reference``, ``pd_kernels.triton`` and
``pd_kernels.cpu`` are checked against it here instead of being copied from it.
"""

from __future__ import annotations

import inspect

import pytest

import pd_kernels
import pd_kernels.cpu
import pd_kernels.triton
from pd_kernels import reference

OPS = ["unified_attention", "store_kv", "rms_norm", "rotary_embedding", "silu_and_mul", "fused_moe", "lora_delta"]
BACKENDS = {"reference": reference, "triton": pd_kernels.triton, "cpu": pd_kernels.cpu}


def _parameters(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    """Names, kinds and defaults; annotations are left to the typed twins' own comparison."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_backend_takes_the_public_arguments(op, backend):
    public = _parameters(getattr(pd_kernels, op))
    assert public[-1][0] == "backend"  # the dispatcher's own, keyword-only, last
    assert _parameters(getattr(BACKENDS[backend], op)) == public[:-1]


@pytest.mark.parametrize("op", OPS)
def test_triton_twin_has_the_references_types(op):
    assert inspect.signature(getattr(pd_kernels.triton, op)) == inspect.signature(getattr(reference, op))
