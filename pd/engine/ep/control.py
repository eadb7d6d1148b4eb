"""An engine's handle on its expert parallelism: what its ranks run between steps, and what operators ask.

``LLMEngine.experts`` is one of these. Without expert parallelism it has no
ranks' experts: its statistics are empty and a rebalance is refused, naming why.
"""

from __future__ import annotations

from typing import Callable

from pd.engine.ep.dispatch import ExpertParallel
from pd.engine.ep.schedule import EplbSchedule
from pd.engine.tp.driver import ExpertsOp, TPWorkers
from pd.model.moe import MoeWeights


class ExpertsControl:
    """One rank's: ``run`` an op at a step boundary. The driver's also has the ``schedule`` (when the ranks
    sync and move) and the ``workers`` it sends each op to."""

    def __init__(self, experts: ExpertParallel | None, weights_of: Callable[[int], MoeWeights] | None = None,
                 moves_per_step: int = 0, schedule: EplbSchedule | None = None, workers: TPWorkers | None = None):
        self.experts = experts
        self.weights_of = weights_of  # a layer's MoE weights, as the rank holds them now
        self.moves_per_step = moves_per_step
        self.schedule = schedule
        self.workers = workers

    def run(self, op: ExpertsOp) -> bool:
        """Every rank's part of a sync or a move, at the same step boundary; False while a layer's move is
        under way (it goes on before the next step)."""
        if op.sync_load:
            self.experts.sync_load()
        if op.move_layer >= 0:
            return self.experts.move_layer(op.move_layer, self.weights_of(op.move_layer), self.moves_per_step)
        return True

    def before_step(self) -> None:
        """The driver's: what the schedule asks before this step, sent to every rank and run here."""
        if self.schedule is None:
            return
        sync_load, layer = self.schedule.next_op()
        if not sync_load and layer is None:
            return
        op = ExpertsOp(sync_load, -1 if layer is None else layer)
        for rank in self.workers.connections:
            self.workers.send_to(rank, op)
        try:
            done = self.run(op)
        except RuntimeError as exc:
            raise self.workers.failure(exc) from exc
        if not done:
            self.schedule.again(layer)

    def rebalance(self) -> None:
        """Place every MoE layer's experts anew from the load window (EPLB), moving them from the next step
        on, a few experts a step."""
        self._require().request()

    def sync(self) -> None:
        """Fresh ``stats`` from the next step on (they are otherwise synced every
        ``pd.engine.ep.schedule.LOAD_SYNC_STEPS`` steps and at each rebalance)."""
        self._require().request_sync()

    def _require(self) -> EplbSchedule:
        if self.schedule is None:
            raise ValueError("rebalancing experts needs expert_parallel_size > 1")
        return self.schedule

    def stats(self) -> dict:
        """Per MoE layer, its balancedness and each expert's load as of the ranks' last sync, and the moves'
        and ranks' times (``ExpertParallel.stats``); empty without expert parallelism."""
        return self.experts.stats() if self.experts is not None else {}

    def counters(self) -> dict[str, float]:
        """``EngineStats``' expert-parallel fields (their defaults without expert parallelism)."""
        stats = self.stats()
        if not stats:
            return {}
        return {"expert_balancedness": min(stats["balancedness"].values()), "expert_moves": len(stats["move_seconds"]),
                "expert_move_seconds": sum(stats["move_seconds"])}
