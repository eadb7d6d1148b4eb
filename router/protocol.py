"""What crosses a process to reach a request router: a call's routing hints and replicas' reports.

``RouteHints`` is the first argument of every call to an engine pool, encoded
(the payload follows as the second). Request routers read only this, never
the payload, so routing never depends on what the engines' messages hold.

``RoutingStats`` is what each replica publishes through Serve's
``record_routing_stats`` (under ``ROUTING_STATS_KEY``), refreshed every
``request_routing_stats_period_s``.

A request under a LoRA adapter names it in ``RouteHints.adapter`` (its block
hashes chain from the adapter's root, ``router.hashing.adapter_root_hash``);
a replica reports the adapters in its device slots in ``RoutingStats.adapters``,
of ``max_loras`` slots (``router.adapters``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

from router.events import CacheEvent
from router.policy import ReplicaLoad
from router.step_cost import GRAM_SIZE, NUM_TERMS
from transfer.wire import NonEmptyStr, NonNegativeInt, WireError, WireMessage

ROUTING_STATS_KEY = "pd_routing_stats"


class RouteHints(WireMessage, frozen=True, kw_only=True):
    """Where a call may go. Routers honour ``target_replica_id`` and ``exclude_replica_ids`` first.

    ``block_hashes`` are the prompt's chained block hashes in the engines'
    block size (``router.hashing``); ``num_prompt_tokens`` its length.
    """

    KIND: ClassVar[str] = "route_hints"

    request_id: str
    # The prompt, for prefix-aware placement.
    num_prompt_tokens: NonNegativeInt = 0
    block_hashes: tuple[bytes, ...] = ()
    # The LoRA adapter it runs under, by name; None: the base model.
    adapter: NonEmptyStr | None = None
    # Where the call must or must not go.
    target_replica_id: str | None = None
    exclude_replica_ids: tuple[str, ...] = ()


class RoutingStats(WireMessage, frozen=True, kw_only=True):
    """One replica's load and the prefix-cache events still in its window.

    ``cache_events`` are compacted to each ``CacheEvent.key``'s latest event, in
    ``seq`` order; they cover every event numbered ``cache_events_from`` or later, so
    a reader that applied events only up to ``cache_events_from - 2`` missed some.
    """

    KIND: ClassVar[str] = "routing_stats"

    # This replica's report number, from 1 (0: never numbered). A reader that sees the same number again has
    # heard nothing new: a replica that stopped answering keeps its last report, which then grows stale.
    seq: NonNegativeInt = 0
    # Load, as the policies weigh it.
    num_running: NonNegativeInt = 0
    num_waiting: NonNegativeInt = 0
    num_waiting_tokens: NonNegativeInt = 0  # prompt tokens queued or running, not yet computed
    num_waiting_pairs: NonNegativeInt = 0  # the query-key pairs those tokens will attend
    num_decoding: NonNegativeInt = 0  # running requests past their prompt
    num_decode_context_tokens: NonNegativeInt = 0  # the tokens those attend to, each step
    kv_usage: float = 0.0
    num_free_blocks: NonNegativeInt = 0
    # KV pulled from prefill replicas, cumulative: what a router prices a transfer from.
    num_pulled_blocks: NonNegativeInt = 0
    pull_seconds_total: float = 0.0
    # The engine's step sums (router.step_cost.StepSums), cumulative: what a router fits its step cost from.
    step_gram: tuple[float, ...] = ()
    step_moments: tuple[float, ...] = ()
    # The LoRA adapters in its device slots, each named once, of its max_loras slots (0: it serves none).
    adapters: tuple[NonEmptyStr, ...] = ()
    max_loras: NonNegativeInt = 0
    # The prefix cache's event window.
    cache_events_from: NonNegativeInt = 0
    cache_events: tuple[CacheEvent, ...] = ()

    def validate(self) -> None:
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if not (math.isfinite(self.pull_seconds_total) and self.pull_seconds_total >= 0):
            raise ValueError(f"pull_seconds_total must be finite and >= 0, got {self.pull_seconds_total}")
        if self.step_gram or self.step_moments:
            if (len(self.step_gram), len(self.step_moments)) != (GRAM_SIZE, NUM_TERMS):
                raise ValueError(f"step_gram and step_moments need {GRAM_SIZE} and {NUM_TERMS} entries, got "
                                 f"{len(self.step_gram)} and {len(self.step_moments)}")
            if not all(math.isfinite(value) for value in (*self.step_gram, *self.step_moments)):
                raise ValueError("step_gram and step_moments must be finite")
        if len(self.adapters) > self.max_loras:
            raise ValueError(f"{len(self.adapters)} adapters held in {self.max_loras} slots (max_loras)")
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError(f"adapters must name each adapter once, got {list(self.adapters)}")

    @classmethod
    def of(cls, first_seq: int, events: Sequence[CacheEvent], **load: Any) -> "RoutingStats":
        """Stats with ``load`` fields and a block pool's event window (``CacheEventLog.window``), carried as is."""
        return cls(cache_events_from=first_seq, **load, cache_events=tuple(events))

    @property
    def last_seq(self) -> int | None:
        """The newest event's number; None when the window is empty."""
        return self.cache_events[-1].seq if self.cache_events else None

    def publish(self) -> dict[str, bytes]:
        """What ``record_routing_stats`` returns."""
        return {ROUTING_STATS_KEY: self.encode()}


NO_STATS = RoutingStats()


def replica_load(replica_id: str, stats: RoutingStats) -> ReplicaLoad:
    """A replica's reported load, as the policies take it."""
    return ReplicaLoad(
        replica_id=replica_id,
        queued_prefill_tokens=stats.num_waiting_tokens,
        num_active_requests=stats.num_running + stats.num_waiting,
        kv_usage=stats.kv_usage,
        adapters=stats.adapters,
        max_loras=stats.max_loras,
    )


def read_route_hints(data: Any) -> RouteHints | None:
    """The hints of a call's first argument; None for a call that carries none (route by policy alone)."""
    if not isinstance(data, (bytes, bytearray)):
        return None
    try:
        return RouteHints.decode(data)
    except WireError:
        return None
