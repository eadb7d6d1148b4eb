"""Every use of Ray's private API, in one place.

Tested with Ray 2.60.0 (``ray[serve]>=2.60,<2.61`` in pyproject.toml; the
newest release in the package index). The one before, 2.59.0, fails here
(``AutoscalingContext`` requires ``total_pending_async_requests``) and in the
served autoscaling, isolation and fault tests, so the range does not reach it. Ray may change anything private in any
release, so nothing else in the repository imports a private Ray name (a
module or attribute starting with ``_``): it calls one of the functions here.
``tests/autoscale/test_ray_internals.py`` imports each name of ``PRIVATE_API``
and compares the parameters we pass with the installed Ray's, so a release
that renames or reshapes one fails there, naming it, before a simulator run or
a benchmark does.

It is also the simulator's one door to Ray (``sim`` imports nothing else of
Ray, and this module only inside functions): ``autoscaling_config``.

Uses:

- ``ray_default_replicas``: Ray Serve's default autoscaling policy (queue
  length, scaling factors, up/down-scale delays), run in the simulator as the
  baseline the SLO planner is compared with (``sim.autoscale``).
- ``direct_ingress_ports``: the ports an ingress replica serves HTTP on itself
  (``bench.serve``'s direct-ingress modes).
- ``ray_prefix_tree``: Ray Serve LLM's prefix tree, which ``bench.ray_prefix``
  drives as the peer prefix-aware router.

Ray is imported inside each function, so importing this module costs nothing
and the simulator imports it only where a Ray baseline is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

TESTED_RAY_VERSION = "2.60.0"


@dataclass(frozen=True)
class PrivateName:
    """One private Ray name we call, and the parameters we pass it (by name, or by position in this order)."""

    module: str
    attribute: str
    parameters: tuple[str, ...] = ()  # empty: a constant, or a class we only construct without arguments
    methods: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (method, parameters after self) we call on it

    def load(self) -> Any:
        return getattr(importlib.import_module(self.module), self.attribute)


_AUTOSCALING_POLICY = "ray.serve.autoscaling_policy"
_PREFIX_TREE = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree"

DEPLOYMENT_ID = PrivateName("ray.serve._private.common", "DeploymentID", ("name", "app_name"))
APPLY_SCALING_FACTORS = PrivateName(_AUTOSCALING_POLICY, "_apply_scaling_factors",
                                    ("desired_num_replicas", "current_num_replicas", "autoscaling_config"))
APPLY_DELAY_LOGIC = PrivateName(_AUTOSCALING_POLICY, "_apply_delay_logic",
                                ("desired_num_replicas", "curr_target_num_replicas", "config", "policy_state",
                                 "_now"))
DIRECT_INGRESS_MIN_PORT = PrivateName("ray.serve._private.constants", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT")
DIRECT_INGRESS_MAX_PORT = PrivateName("ray.serve._private.constants", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
PREFIX_TREE = PrivateName(_PREFIX_TREE, "PrefixTree", (), (
    ("add_tenants", ("tenants", "time_s")),
    ("prefix_match", ("text", "available_tenants")),
    ("get_smallest_tenants", ()),
    ("insert", ("text", "tenant", "time_s")),
))
# Public names whose keyword arguments we fill in full: a new required field fails the test too.
AUTOSCALING_CONTEXT_FIELDS = (
    "deployment_id", "deployment_name", "app_name", "current_num_replicas", "target_num_replicas",
    "running_replicas", "total_num_requests", "total_queued_requests", "aggregated_metrics", "raw_metrics",
    "capacity_adjusted_min_replicas", "capacity_adjusted_max_replicas", "policy_state", "last_scale_up_time",
    "last_scale_down_time", "current_time", "config",
)

PRIVATE_API = (DEPLOYMENT_ID, APPLY_SCALING_FACTORS, APPLY_DELAY_LOGIC, DIRECT_INGRESS_MIN_PORT,
               DIRECT_INGRESS_MAX_PORT, PREFIX_TREE)


def autoscaling_config(min_replicas: int, max_replicas: int, **overrides):
    """A ``ray.serve.config.AutoscalingConfig`` (public API) for ``ray_default_replicas``."""
    from ray.serve.config import AutoscalingConfig

    return AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas, **overrides)


def ray_default_replicas(name: str, config, ongoing: float, num_serving: int, num_target: int,
                         policy_state: dict, now_s: float) -> tuple[float, dict]:
    """Ray Serve's default policy's decision for one deployment of app ``pd``: (replicas wanted, its new state).

    ``config`` is the deployment's ``ray.serve.config.AutoscalingConfig``;
    ``ongoing`` the requests in flight at its replicas, averaged over the
    look-back window; ``policy_state`` what the last call returned (``{}`` at
    first). The result is before the min/max bounds, as Ray's controller has it.
    """
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
    from ray.serve.config import AutoscalingContext

    deployment_id = DEPLOYMENT_ID.load()(name=name, app_name="pd")
    context = AutoscalingContext(
        deployment_id=deployment_id, deployment_name=name, app_name="pd",
        current_num_replicas=num_serving, target_num_replicas=num_target, running_replicas=[],
        total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics={}, raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=policy_state, last_scale_up_time=None, last_scale_down_time=None,
        current_time=now_s, config=config)
    desired, _ = replica_queue_length_autoscaling_policy(context)
    desired = APPLY_SCALING_FACTORS.load()(desired, num_serving, config)
    return APPLY_DELAY_LOGIC.load()(max(0, desired), num_target, config, policy_state, _now=now_s)


def direct_ingress_ports() -> range:
    """The ports Serve's direct ingress hands its replicas, in order (the last one excluded, as Ray's range)."""
    return range(DIRECT_INGRESS_MIN_PORT.load(), DIRECT_INGRESS_MAX_PORT.load())


def ray_prefix_tree():
    """A new, empty Ray Serve LLM ``PrefixTree`` (its methods used: ``PREFIX_TREE.methods``)."""
    return PREFIX_TREE.load()()
