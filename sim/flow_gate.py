"""The app's flow control in simulated time: ``router.flow_control.FlowController`` before every placement.

A ``SimCluster``'s ``Gate``, driving the controller as the app's ingress
does (``router.flow_control``'s docstring):

- each request, once the ingress has done its own work on it: classified
  (one it cannot classify is refused, as the app answers 400), then
  decided with the routers' prediction for its prompt: the prefill pool's
  predicted-latency router's where the remote-prefill rule may send it
  there, the decode router's otherwise (``PoolPredictions.best``);
- each report period: every serving replica's ``RoutingStats`` observed,
  with its pool's predicted backlog there (``LatencyPredictor.wait_s``) and decode
  step (``router.flow_capacity.decode_step_s``);
  replicas gone are forgotten;
- each request finished, and each wake-up the controller asks for
  (``next_wake_s``), and after every decide: ``poll``, its answers applied.

What it decided is kept per request (``outcomes``), with the times of
admissions for the drain actually seen after a shed (``sim.flow``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from router.flow_capacity import ReplicaReport, decode_step_s
from router.flow_config import FlowIdentity, FlowRequest, FlowRequestError
from router.flow_control import Admit, FlowController, Shed, Wait
from router.latency import LatencyPredictor, Prediction
from router.protocol import NO_STATS
from router.remote_prefill import PoolPredictions
from sim.clock import EventLoop
from sim.placement import LatencyPlacement


@dataclass
class GateOutcome:
    """What flow control made of one request."""

    request: FlowRequest | None  # None: refused before it was classified (``error``)
    admit: Admit | None = None
    shed: Shed | None = None
    decided_s: float | None = None  # when it was admitted or shed
    error: str | None = None  # the 400 it would have been answered with


class FlowGate:
    """``controller`` before ``cluster``'s placements (module docstring); ``attach`` it to a ``SimCluster``."""

    def __init__(self, loop: EventLoop, controller: FlowController, tick_s: float = 1.0) -> None:
        self.loop = loop
        self.controller = controller
        self.tick_s = tick_s  # while requests wait, the gate looks again at least this often
        self.cluster = None
        self.outcomes: dict[str, GateOutcome] = {}
        self.admissions: list[tuple[float, int]] = []  # (when, cost in tokens) of every request admitted
        self._releases: dict[str, Callable[[bool], None]] = {}
        self._observed: dict[str, set[str]] = {}
        self._wake_s: float | None = None

    def attach(self, cluster) -> "FlowGate":
        """Stand before ``cluster`` (a ``SimCluster``)."""
        self.cluster = cluster
        cluster.gate = self
        return self

    # The cluster's calls -----------------------------------------------------------------

    def arrive(self, request_id: str, identity: FlowIdentity, block_hashes: Sequence[bytes], num_prompt_tokens: int,
               max_tokens: int, arrival_s: float, release: Callable[[bool], None]) -> None:
        now = self.loop.now
        try:
            request = self.controller.classify(request_id, identity, num_prompt_tokens, max_tokens, arrival_s)
        except FlowRequestError as exc:
            self.outcomes[request_id] = GateOutcome(None, decided_s=now, error=str(exc))
            release(False)
            return
        self.outcomes[request_id] = GateOutcome(request)
        self._releases[request_id] = release
        outcome = self.controller.decide(request, self._prediction(block_hashes, num_prompt_tokens), now)
        if not isinstance(outcome, Wait):
            self._apply(outcome)
        self._poll()

    def reported(self) -> None:
        now = self.loop.now
        for pool in self.cluster.pools():
            predictor = self._predictor(pool.name)
            serving = set(pool.replica_ids)
            for replica_id in sorted(self._observed.get(pool.name, set()) - serving):
                self.controller.forget(pool.name, replica_id)
            self._observed[pool.name] = serving
            for replica_id in pool.replica_ids:
                stats = pool.reports.get(replica_id, NO_STATS)
                if stats is NO_STATS:
                    continue  # no report yet
                ready = predictor is not None and predictor.ready()
                backlog = predictor.wait_s(replica_id, now) if ready else None
                step = decode_step_s(predictor, replica_id, stats) if ready else None
                self.controller.observe(pool.name, replica_id, ReplicaReport.of(stats, backlog, step), now)
        self._poll()

    def finished(self, request_id: str, num_output_tokens: int) -> None:
        self.controller.finished(request_id, num_output_tokens, self.loop.now)
        self._poll()

    # Internals -----------------------------------------------------------------------------

    def _prediction(self, block_hashes: Sequence[bytes], num_prompt_tokens: int) -> Prediction | None:
        cluster = self.cluster
        remote = cluster.prefill is not None and cluster.spec.rule.may_go_remote(num_prompt_tokens)
        pool = cluster.prefill if remote else cluster.decode
        predictor = self._predictor(pool.name)
        if predictor is None:
            return None
        return PoolPredictions(predictor, pool.index, pool.replica_ids).best(block_hashes, num_prompt_tokens,
                                                                             self.loop.now)

    def _predictor(self, pool_name: str) -> LatencyPredictor | None:
        """The pool's router's latency predictor: the decode router's, the prefill router's where it predicts."""
        cluster = self.cluster
        if pool_name == "decode":
            return cluster.decode_policy.predictor
        placement = cluster.prefill.placement
        return placement.policies[0].predictor if isinstance(placement, LatencyPlacement) else None

    def _poll(self) -> None:
        for outcome in self.controller.poll(self.loop.now):
            self._apply(outcome)
        self._schedule()

    def _apply(self, outcome: Admit | Shed) -> None:
        request_id = outcome.request.request_id
        record = self.outcomes[request_id]
        record.decided_s = self.loop.now
        release = self._releases.pop(request_id)
        if isinstance(outcome, Admit):
            record.admit = outcome
            self.admissions.append((self.loop.now, outcome.request.cost))
            release(True)
        else:
            record.shed = outcome
            release(False)

    def _schedule(self) -> None:
        """A wake-up at the next expiry, and at least every ``tick_s`` while anything waits."""
        if not self.controller.num_waiting:
            return
        wake = self.controller.next_wake_s()
        wake = self.loop.now + self.tick_s if wake is None else min(wake, self.loop.now + self.tick_s)
        if self._wake_s is not None and self._wake_s <= wake:
            return
        self._wake_s = wake
        self.loop.at(wake, lambda: self._woken(wake))

    def _woken(self, wake: float) -> None:
        if self._wake_s != wake:
            return  # superseded by an earlier wake-up
        self._wake_s = None
        self._poll()
