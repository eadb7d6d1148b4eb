"""Tensor-parallel workers of a Serve replica: Ray actors in the replica's placement group.

The deployment asks Serve for one bundle per rank (``PoolArgs.rank_bundle``,
STRICT_PACK: one node). The replica's actor runs in bundle 0 and is rank 0;
rank ``r`` is a ``TPWorker`` actor in bundle ``r``, holding that bundle's
CPUs and GPUs (Ray sets its ``CUDA_VISIBLE_DEVICES``, so its device is
``cuda``). Workers are owned by the replica's actor, so Ray stops them with
it; a worker that dies fails the replica's next step, its health check
fails, and Serve replaces the replica.
"""

from __future__ import annotations

import ray
import torch
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pd.engine.tp.driver import WorkerSpec, worker_spec_json


@ray.remote
class TPWorker:
    """Rank ``spec.rank``: ``run`` serves it until its driver stops it or goes away."""

    def run(self, spec_json: bytes) -> None:
        from pd.engine.tp.driver import read_worker_spec
        from pd.engine.tp.worker import serve_rank

        serve_rank(read_worker_spec(spec_json))


class RayLauncher:
    """Starts ranks 1..N-1 in the current placement group's bundles 1..N-1."""

    def __init__(self, placement_group: PlacementGroup | None = None):
        self.placement_group = placement_group or get_current_placement_group()
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.runs: dict[int, ray.ObjectRef] = {}

    def check(self, size: int, device: torch.device) -> None:
        bundles = len(self.placement_group.bundle_specs) if self.placement_group is not None else 0
        if bundles < size:
            raise ValueError(f"a replica of {size} ranks (tensor_parallel_size, expert_parallel_size) needs a placement group of {size} bundles, one per rank; "
                             f"this replica's has {bundles}")
        if device.type == "cuda":
            short = [i for i, bundle in enumerate(self.placement_group.bundle_specs[:size]) if not bundle.get("GPU")]
            if short:
                raise ValueError(f"{size} ranks on CUDA need a GPU in every rank's bundle; "
                                 f"bundles {short} have none")

    def device_of(self, rank: int, device: torch.device) -> str:
        return device.type  # the actor sees its own GPU as device 0

    def launch(self, spec: WorkerSpec) -> None:
        bundle = self.placement_group.bundle_specs[spec.rank]
        actor = TPWorker.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=spec.rank),
        ).remote()
        self.actors[spec.rank] = actor
        self.runs[spec.rank] = actor.run.remote(worker_spec_json(spec))

    def stop(self, timeout_s: float) -> None:
        """Wait for each worker's ``run`` to return (it was told to stop), killing any that does not in time."""
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
        self.runs.clear()
