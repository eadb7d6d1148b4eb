"""A ``ClusterSpec`` from a serving app's args: the same YAML ``serve run`` takes, read by its own schema.

The args are validated by ``pd.config.app.AppArgs`` (the app's one schema,
which needs no running Ray), so the simulator reads replica counts, engine
limits, the remote-prefill rule and the routers' kwargs exactly as the app
does. A replica computes on ``ceil(num_cpus)`` threads (as
``pd.serve.engine_server.replica_threads`` gives it within the machine's
cores), and its steps of few tokens on ``floor(num_cpus)`` (as
``replica_decode_threads`` does; ``engine.decode_threads`` overrides it);
``cost_for_threads`` gives the profile for each count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from pd.config import EngineConfig
from pd.config.app import DECODE_ROUTER, PREFILL_ROUTER, AppArgs, PoolArgs
from sim.cluster import PREFILL_ROUTERS, ClusterSpec, PoolSpec
from sim.cost import CostModel
from sim.transport import TransferModel

# The project's routers the simulator runs, per pool: the real policies, unmodified.
SIMULATED_ROUTERS = {"prefill": PREFILL_ROUTERS, "decode": (DECODE_ROUTER,)}


def pool_threads(pool: PoolArgs, engine: EngineConfig | None = None) -> int:
    """A pool replica's compute threads: ``engine.num_threads`` where the config gives it."""
    if engine is not None and engine.num_threads is not None:
        return engine.num_threads
    num_cpus = pool.ray_actor_options.get("num_cpus") or 1
    return max(1, math.ceil(num_cpus))


def pool_decode_threads(pool: PoolArgs, engine: EngineConfig) -> int:
    """The threads of a pool replica's steps of few tokens (``pd.engine.model_runner.step_threads``)."""
    if engine.decode_threads is not None:
        return engine.decode_threads
    if engine.num_threads is not None:  # a replica given its threads computes every step on them
        return engine.num_threads
    num_cpus = pool.ray_actor_options.get("num_cpus") or 1
    return max(1, math.floor(num_cpus))


def _policy_kwargs(name: str, pool: PoolArgs) -> dict[str, Any]:
    router = pool.router
    if router.request_router_class not in (None, *SIMULATED_ROUTERS[name]):
        raise ValueError(f"{name}.router.request_router_class {router.request_router_class!r}: the simulator "
                         f"runs the project's own routers only ({', '.join(SIMULATED_ROUTERS[name])})")
    return dict(router.request_router_kwargs)


def cluster_spec(args: dict | AppArgs, cost_for_threads: Callable[[int], CostModel], transfer: TransferModel,
                 call_s: float = 0.0, seed: int = 0) -> ClusterSpec:
    app = args if isinstance(args, AppArgs) else AppArgs.parse(args)
    if app.decode.num_replicas is None or (app.mode == "disaggregated" and app.prefill.num_replicas is None):
        raise ValueError("the simulator needs fixed num_replicas in each pool (autoscaling is not simulated yet)")

    def pool(name: str, args: PoolArgs) -> PoolSpec:
        engine = app.engine_config(name)  # with the pool's own ranks (an expert-parallel pool needs its cost)
        threads = pool_threads(args, engine)
        if engine.device != "cpu":
            return PoolSpec(args.num_replicas, engine, cost_for_threads(threads), threads)
        decode_threads = pool_decode_threads(args, engine)
        replica = dataclasses.replace(engine, num_threads=threads, decode_threads=decode_threads)
        return PoolSpec(args.num_replicas, replica, cost_for_threads(threads), threads,
                        decode_cost=cost_for_threads(decode_threads))

    disaggregated = app.mode == "disaggregated"
    return ClusterSpec(
        decode=pool("decode", app.decode),
        prefill=pool("prefill", app.prefill) if disaggregated else None,
        rule=app.remote_prefill_rule(),
        prefill_router=(app.prefill.router.request_router_class or PREFILL_ROUTER) if disaggregated else PREFILL_ROUTER,
        prefill_policy=_policy_kwargs("prefill", app.prefill) if disaggregated else {},
        decode_policy=_policy_kwargs("decode", app.decode),
        transfer=transfer,
        report_period_s=app.decode.router.request_routing_stats_period_s,
        call_s=call_s,
        seed=seed,
    )
