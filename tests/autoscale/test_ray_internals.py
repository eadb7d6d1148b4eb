"""Each private Ray name we call still exists and takes the parameters we pass it.

A Ray release that renames, moves or reshapes one fails here, naming the
name and what changed, instead of deep inside a simulator run or a benchmark.
Nothing starts Ray: the names are imported and inspected.
"""

from __future__ import annotations

import inspect

import pytest

from autoscale import ray_internals
from autoscale.ray_internals import AUTOSCALING_CONTEXT_FIELDS, PRIVATE_API, TESTED_RAY_VERSION, PrivateName

ray = pytest.importorskip("ray")


def _parameter_names(function) -> list[str]:
    """Parameter names in order, without ``self`` and Ray's tracing hook ``_ray_trace_ctx``."""
    return [name for name in inspect.signature(function).parameters if name not in ("self", "_ray_trace_ctx")]


def _where(name: PrivateName) -> str:
    return f"{name.module}.{name.attribute} (tested with Ray {TESTED_RAY_VERSION}, installed: {ray.__version__})"


@pytest.mark.parametrize("name", PRIVATE_API, ids=lambda name: name.attribute)
def test_each_private_name_exists_with_the_parameters_we_pass(name: PrivateName):
    try:
        value = name.load()
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{_where(name)} is gone: {exc}; update autoscale/ray_internals.py")
    if name.parameters:
        actual = _parameter_names(value)
        assert actual[: len(name.parameters)] == list(name.parameters), (
            f"{_where(name)} takes {actual}, we pass {list(name.parameters)}")
    for method, parameters in name.methods:
        assert hasattr(value, method), f"{_where(name)} has no method {method!r}"
        actual = _parameter_names(getattr(value, method))
        assert actual[: len(parameters)] == list(parameters), (
            f"{_where(name)}.{method} takes {actual}, we pass {list(parameters)}")


def test_the_direct_ingress_ports_are_a_range():
    ports = ray_internals.direct_ingress_ports()
    assert len(ports) > 0 and all(isinstance(port, int) for port in (ports.start, ports.stop)), ports


def test_the_autoscaling_context_takes_the_fields_we_fill():
    from ray.serve.config import AutoscalingContext

    actual = _parameter_names(AutoscalingContext)
    assert actual == list(AUTOSCALING_CONTEXT_FIELDS), (
        f"ray.serve.config.AutoscalingContext takes {actual}, we fill {list(AUTOSCALING_CONTEXT_FIELDS)} "
        f"(tested with Ray {TESTED_RAY_VERSION}, installed: {ray.__version__})")


def test_ray_default_policy_runs_and_scales_up_under_load():
    """One decision through the adapter: a queue far over target asks for more replicas, after no delay."""
    config = ray_internals.autoscaling_config(1, 8, target_ongoing_requests=2, upscale_delay_s=0)
    decided, state = ray_internals.ray_default_replicas("decode", config, ongoing=40.0, num_serving=1,
                                                        num_target=1, policy_state={}, now_s=10.0)
    assert decided > 1
    assert isinstance(state, dict)


def test_the_prefix_tree_is_built_empty():
    tree = ray_internals.ray_prefix_tree()
    tree.add_tenants(["a"], 0.0)
    tree.insert("hello", "a", 0.0)
    matched_text, tenants = tree.prefix_match("help", ["a"])
    assert matched_text == "hel" and tenants == ["a"]
