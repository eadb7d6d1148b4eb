"""What one pool's request routers share with their caller in the same process.

Ray Serve builds request routers inside the process that calls a deployment
(the ingress), from kwargs it serializes, so no live object can be handed to
them. The caller owns a ``RoutingScopes`` instead, as its ``routing_scopes``
attribute, and the app gives each pool's routers the name of their scope in
their kwargs. A router finds its caller through Serve's replica context
(``servable_object``) and opens the pool's ``PoolRouting`` there; the caller
asks the same object which replica a call went to and how much of a prompt
the pool already holds. A router running anywhere else keeps a private one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from router.flow_capacity import decode_step_s
from router.latency import LatencyPredictor
from router.policy import uncached_tokens
from router.prefix_index import PrefixIndex
from router.protocol import RoutingStats
from router.remote_prefill import PoolPredictions

# Request ids whose routed replica is remembered, per pool.
MAX_REMEMBERED = 4096
# The scope names of the app's two pools.
PREFILL_SCOPE = "prefill"
DECODE_SCOPE = "decode"


class PoolRouting:
    """One pool's routing knowledge in this process: its live replicas, where calls went, its prefix index."""

    def __init__(self) -> None:
        self._routed: OrderedDict[str, str] = OrderedDict()
        self._decided: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._index: PrefixIndex | None = None
        self._block_size = 0
        self._live: set[str] | None = None  # None until a router has seen the pool
        self._predictor: LatencyPredictor | None = None
        self.quarantined: frozenset[str] = frozenset()  # slow replicas its router holds back (router.gray)
        # Each replica's last slowness reading, confirmed or not (router.gray.probe_targets reads it).
        self.slowness: dict[str, float] = {}
        self.replace_due: dict[str, str] = {}  # replicas quarantined too long -> why Serve should replace them
        # Each serving replica's latest RoutingStats, replaced whole by the router as Serve hands it new ones
        # (flow control reads it from the ingress's own loop: one assignment, never a dict changing under it).
        self.reports: dict[str, RoutingStats] = {}

    def is_quarantined(self, replica_id: str | None) -> bool:
        return replica_id in self.quarantined

    def set_replicas(self, replica_ids) -> None:
        """The pool's running replicas, as Serve last told the router."""
        self._live = set(replica_ids)

    def mark_dead(self, replica_id: str) -> None:
        """A replica a call found dead, before Serve says so."""
        if self._live is not None:
            self._live.discard(replica_id)

    def has_live_replica(self, excluding=()) -> bool:
        """Whether a call could reach a replica other than ``excluding`` now (True while nothing is known)."""
        return self._live is None or bool(self._live.difference(excluding))

    def is_live(self, replica_id: str) -> bool:
        return self._live is None or replica_id in self._live

    def note_routed(self, request_id: str, replica_id: str) -> None:
        self._routed[request_id] = replica_id
        self._routed.move_to_end(request_id)
        while len(self._routed) > MAX_REMEMBERED:
            self._routed.popitem(last=False)

    def note_decision(self, request_id: str, reason: str, matched_tokens: int) -> None:
        """Why a policy router chose where ``request_id`` went, and the prompt tokens that replica held."""
        self._decided[request_id] = (reason, matched_tokens)
        self._decided.move_to_end(request_id)
        while len(self._decided) > MAX_REMEMBERED:
            self._decided.popitem(last=False)

    def routed_decision(self, request_id: str) -> tuple[str, int] | None:
        """(reason, matched prompt tokens) of the policy's decision for ``request_id``; None where none decided."""
        return self._decided.get(request_id)

    def routed_replica(self, request_id: str) -> str | None:
        """The replica the last call for ``request_id`` was routed to."""
        return self._routed.get(request_id)

    def set_reports(self, reports: dict[str, RoutingStats]) -> None:
        """The pool's serving replicas and their latest reports (``reports``; flow control's ``Capacity``)."""
        self.reports = reports

    def backlog_s(self, replica_id: str, now_s: float) -> float | None:
        """The predicted prompt work queued at ``replica_id``; None until a router shared a ready predictor."""
        predictor = self._predictor
        return predictor.wait_s(replica_id, now_s) if predictor is not None and predictor.ready() else None

    def decode_step_s(self, replica_id: str, stats: RoutingStats) -> float | None:
        """The predicted time of ``replica_id``'s decode step at the decodes ``stats`` report (its inter-token
        latency), from the step cost model the router fits; None without decodes or a ready predictor."""
        return decode_step_s(self._predictor, replica_id, stats) if self._predictor is not None else None

    def share_predictor(self, predictor: LatencyPredictor) -> None:
        """A router's latency predictor of this pool (``router.latency``), fed by that router's reports."""
        self._predictor = predictor

    def predictions(self) -> PoolPredictions | None:
        """The pool's predictor, index and live replicas, for the predicted remote-prefill rule; None until a
        router shared a predictor and an index and has seen the pool."""
        if self._predictor is None or self._index is None or not self._live:
            return None
        return PoolPredictions(self._predictor, self._index, sorted(self._live))

    def share_index(self, index: PrefixIndex, block_size: int) -> None:
        """A router's prefix index of this pool, kept up to date by that router."""
        self._index, self._block_size = index, block_size

    def estimate_uncached_tokens(self, block_hashes: Sequence[bytes], num_prompt_tokens: int) -> int:
        """Prompt tokens the best-placed replica would compute itself; all of them until a router shared its index.

        A block the replica holds in any tier, or can read from the shared store, is not computed.
        """
        if self._index is None or not block_hashes:
            return num_prompt_tokens
        runs = self._index.match_tiers(block_hashes)
        return uncached_tokens({replica_id: len(run) for replica_id, run in runs.items()}, self._block_size,
                               num_prompt_tokens)


class RoutingScopes:
    """The ``PoolRouting`` of each scope name, owned by the caller of the pools."""

    def __init__(self) -> None:
        self._pools: dict[str, PoolRouting] = {}

    def open(self, scope: str) -> PoolRouting:
        """The scope's pool routing, made on first use."""
        if not scope:
            raise ValueError("a routing scope needs a name")
        return self._pools.setdefault(scope, PoolRouting())
