"""Prefill placement, and the decision both pools' policies share. Pure Python, no Ray.

Prefill placement scores every candidate replica in prompt-token units:

    cost(r) = w_prefix * uncached_prompt_tokens(r) + w_load * (load(r) + adapter_load(r))

    uncached_prompt_tokens(r) = num_prompt_tokens
                              - sum over r's matched blocks of value(tier) * tokens reused there

    load(r) = queued_prefill_tokens(r)                                   reported
            + request_load_tokens  * num_active_requests(r)              reported
            + kv_usage_load_tokens * kv_usage(r)                         reported
            + unreported_prefill_weight * unreported_prefill_tokens(r)    this router's own
            + recent_prefill_weight * (recent_prefill_tokens(r) - least)  this router's own
            + recent_request_load_tokens * (recent_requests(r) - least)  this router's own

``value(tier)`` is what a hit in the tier holding the block is worth, as a
fraction of a device hit (``router.tiers``): a host hit saves its compute but
must be loaded first. A block in the shared store counts for every replica.
With device hits only, ``uncached_prompt_tokens`` is the prompt less its
longest cached prefix.

``adapter_load(r)`` is what the request's LoRA adapter takes there
(``router.adapters``), 0 for a request on the base model:

    adapter_load(r) = 0                                           r holds the adapter
                    = adapter_load_tokens                         a free slot: one copy of its weights
                    = 2 * adapter_load_tokens + adapter_wait_tokens   every slot held: the copy, the
                                                                  evicted adapter's next copy, the wait

``adapter_load_tokens`` is a copy's time in prompt tokens' prefill time;
``adapter_wait_tokens`` prices waiting for a slot, and the churn of bringing
one more adapter into a replica's full slots, as ``w_prefix`` prices a prefix
copied into a second cache. The prompt's block hashes chain from its
adapter's root, so ``uncached_prompt_tokens`` counts only blocks cached under
the same adapter.

``unreported_prefill_tokens`` are the uncached prompt tokens this router sent
a replica since that replica's last report (``reported``): queued work its
report cannot show yet.

``recent_*`` count what this router sent each replica, decaying over about
``recent_window`` decisions, minus the least among the candidates. They see
load that replicas have not reported yet. Recent prefill tokens also measure
how fast a replica's prefix cache turns over: a prompt nobody holds goes where
cached prefixes are evicted slowest, not where the queue happens to be short
this instant.

The lowest cost wins; ties are broken at random (seeded). ``w_prefix`` above
``w_load`` values a cache hit beyond this request's own prefill time: moving a
request off the replica holding its prefix copies that prefix into a second
cache, evicting someone else's.

A replica over its overload bound is passed over even when it holds the
longest match. The bounds are absolute (queued tokens, active requests, KV
usage) and relative: no replica may be sent more than ``max_routed_ratio``
times the recent requests of the least-routed candidate. Without the relative
bound, a prefix every request shares (one system prompt) would make its holder
the cheapest choice for all of them; so would a hot adapter make the replicas
holding it. When every candidate is over a bound, all are scored as if within
bounds.

Decode placement is ``router.decode_policy``'s; both share ``decide``.

Policies are not thread-safe: a router calls them from its one event loop.
Several ingress replicas each run their own, and each balances its own stream.
"""

from __future__ import annotations

import enum
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from router.adapters import SentAdapters
from router.prefix_index import PrefixIndex
from router.recent import RecentRouted
from router.tiers import TierHitValues, matched_tokens, valued_tokens

# Costs closer than this (relative) are a tie.
_TIE_TOLERANCE = 1e-9
# Recent requests a replica may have beyond max_routed_ratio x the least-routed
# candidate's, so that a handful of decisions cannot trip the bound.
ROUTED_SLACK = 1.0


class RoutingReason(str, enum.Enum):
    """Why a replica was chosen; the label of the routing-decision metric."""

    PREFIX = "prefix"  # it holds the most valuable cached prefix of any candidate (the longest, in one tier)
    LOAD = "load"  # no candidate holds any of the prompt, or a better prefix sat on a busier replica
    OVERLOAD = "overload"  # a replica holding a better prefix was over its bound, or every replica was


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows of one candidate replica's load, from its reports."""

    replica_id: str
    queued_prefill_tokens: int = 0  # prompt tokens waiting to be prefilled there
    num_active_requests: int = 0  # requests waiting or running there
    kv_usage: float = 0.0  # fraction of its KV blocks held by requests, in [0, 1]
    adapters: tuple[str, ...] = ()  # the LoRA adapters in its device slots, by name
    max_loras: int = 0  # its adapter slots; 0: none reported

    def __post_init__(self) -> None:
        if self.queued_prefill_tokens < 0 or self.num_active_requests < 0 or self.max_loras < 0:
            raise ValueError(f"negative load for replica {self.replica_id!r}: {self}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage} for {self.replica_id!r}")


@dataclass(frozen=True)
class RoutingDecision:
    """Where one request goes, why, and how much of its prompt that replica already holds.

    ``matched_tokens`` are the prompt tokens it holds in any tier (or can read
    from the shared store); ``uncached_tokens`` the rest, which it computes.
    """

    replica_id: str
    reason: RoutingReason
    uncached_tokens: int
    matched_tokens: int
    # Every candidate, best first, over-bound ones last: fallbacks for an adapter.
    ranked_replica_ids: tuple[str, ...] = ()
    # The chosen replica's predicted time to first token, in seconds, where a latency policy decided
    # (``router.latency``); None where a token cost did.
    predicted_s: float | None = None
    adapter: str | None = None  # the request's LoRA adapter, as the policy was told it


@dataclass(frozen=True)
class PolicyConfig(TierHitValues):
    """Weights and bounds of prefix-affinity placement; token quantities are prompt tokens.

    ``block_size`` is the engines' (the app sets it from the engine config).
    The defaults are tuned on ``python -m bench.router`` (see its docstring);
    the ``*_hit_value`` fields (``TierHitValues``) are derived in ``router.tiers``.
    """

    block_size: int
    w_prefix: float = 8.0
    w_load: float = 1.0
    request_load_tokens: float = 256.0  # load of one active request
    kv_usage_load_tokens: float = 4096.0  # load of a full KV cache
    unreported_prefill_weight: float = 1.0  # load per prefill token sent since the replica's last report
    recent_prefill_weight: float = 0.1  # load per recent prefill token beyond the least candidate's
    recent_request_load_tokens: float = 256.0  # load per recent request beyond the least candidate's
    recent_window: int = 1024  # decisions over which "recent" decays by 1/e
    # A LoRA adapter's copy into a device slot, in prompt tokens' prefill time: a rank-16 adapter of an 8B model
    # (84 MB) takes about 3.4 ms over PCIe 4, some 100 tokens of an H200's prefill.
    adapter_load_tokens: float = 128.0
    # Waiting for a slot where every one is held, and the churn of one more adapter there (``router.adapters``),
    # in prompt tokens; tuned on ``python -m bench.router_lora``.
    adapter_wait_tokens: float = 4096.0
    # Per-replica overload bounds; None means unbounded.
    max_queued_prefill_tokens: int | None = None
    max_active_requests: int | None = None
    max_kv_usage: float | None = 0.95
    max_routed_ratio: float | None = 1.45
    index_max_blocks: int = 1 << 20  # (block hash, replica) entries in the prefix index
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("w_prefix", "w_load", "request_load_tokens", "kv_usage_load_tokens",
                     "unreported_prefill_weight", "recent_prefill_weight", "recent_request_load_tokens",
                     "adapter_load_tokens", "adapter_wait_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.w_prefix == 0 and self.w_load == 0:
            raise ValueError("w_prefix and w_load cannot both be 0")
        for name in ("max_queued_prefill_tokens", "max_active_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.max_kv_usage is not None and not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage must be in (0, 1] or None, got {self.max_kv_usage}")
        if self.max_routed_ratio is not None and self.max_routed_ratio < 1.0:
            raise ValueError(f"max_routed_ratio must be >= 1 or None, got {self.max_routed_ratio}")
        if self.recent_window < 1:
            raise ValueError(f"recent_window must be >= 1, got {self.recent_window}")
        if self.index_max_blocks < 1:
            raise ValueError(f"index_max_blocks must be >= 1, got {self.index_max_blocks}")


def uncached_tokens(matches: Mapping[str, int], block_size: int, num_prompt_tokens: int) -> int:
    """Prompt tokens left to compute on the replica holding the longest prefix (``PrefixIndex.match``)."""
    return num_prompt_tokens - matched_tokens(max(matches.values(), default=0), block_size, num_prompt_tokens)


class Scored(NamedTuple):
    """One candidate's score, as both policies hand it to ``decide``."""

    replica_id: str
    overloaded: bool
    cost: float
    matched_tokens: int
    valued_tokens: float  # matched tokens, each weighed by its tier's hit value


def decide(scored: list[Scored], num_prompt_tokens: int, rng: random.Random,
           adapter: str | None = None) -> RoutingDecision:
    """Lowest cost among the replicas within bounds (among all when none is); ties at random."""
    eligible = [entry for entry in scored if not entry.overloaded]
    all_overloaded = not eligible
    if all_overloaded:
        eligible = scored
    lowest = min(entry.cost for entry in eligible)
    tolerance = _TIE_TOLERANCE * max(1.0, abs(lowest))
    tied = [entry for entry in eligible if entry.cost <= lowest + tolerance]
    chosen = tied[0] if len(tied) == 1 else rng.choice(tied)

    best_valued = max(entry.valued_tokens for entry in scored)
    best_eligible_valued = max(entry.valued_tokens for entry in eligible)
    if all_overloaded or best_eligible_valued < best_valued:
        reason = RoutingReason.OVERLOAD
    elif 0 < chosen.valued_tokens == best_valued:
        reason = RoutingReason.PREFIX
    else:
        reason = RoutingReason.LOAD
    others = sorted((entry for entry in scored if entry is not chosen),
                    key=lambda entry: (entry.overloaded, entry.cost))
    return RoutingDecision(
        replica_id=chosen.replica_id,
        reason=reason,
        uncached_tokens=num_prompt_tokens - chosen.matched_tokens,
        matched_tokens=chosen.matched_tokens,
        ranked_replica_ids=(chosen.replica_id, *(entry.replica_id for entry in others)),
        adapter=adapter,
    )


class PrefixAffinityPolicy:
    """Chooses the prefill replica: most reusable prefix, least load, never an over-bound one."""

    def __init__(self, config: PolicyConfig, index: PrefixIndex | None = None) -> None:
        self.config = config
        self.index = index if index is not None else PrefixIndex(config.index_max_blocks)
        self.hit_values = config.hit_values()
        self.recent = RecentRouted(config.recent_window)
        self.reason_counts: Counter[RoutingReason] = Counter()
        self._rng = random.Random(config.seed)
        self._unreported_prefill_tokens: dict[str, int] = {}
        self.adapters_sent = SentAdapters()
        # The last decision's prompt, the index version, the replicas matched and their runs (``match_tiers``).
        self._matched: tuple[Sequence[bytes], int, set[str], dict] | None = None

    def reported(self, replica_id: str) -> None:
        """A new report from ``replica_id`` came in: what was sent it before is in its figures."""
        self._unreported_prefill_tokens.pop(replica_id, None)
        self.adapters_sent.reported(replica_id)

    def reported_load(self, replica: ReplicaLoad) -> float:
        """The part of ``load`` that comes from the replica's own report, in prompt tokens."""
        config = self.config
        return (
            replica.queued_prefill_tokens
            + config.request_load_tokens * replica.num_active_requests
            + config.kv_usage_load_tokens * replica.kv_usage
        )

    def loads(self, candidates: Sequence[ReplicaLoad]) -> dict[str, float]:
        """Each candidate's ``load`` (module docstring), in prompt tokens."""
        config, recent = self.config, self.recent
        least_requests = min(recent.requests(replica.replica_id) for replica in candidates)
        least_prefill = min(recent.prefill_tokens(replica.replica_id) for replica in candidates)
        unreported = self._unreported_prefill_tokens
        return {
            replica.replica_id: self.reported_load(replica)
            + config.unreported_prefill_weight * unreported.get(replica.replica_id, 0)
            + config.recent_prefill_weight * (recent.prefill_tokens(replica.replica_id) - least_prefill)
            + config.recent_request_load_tokens * (recent.requests(replica.replica_id) - least_requests)
            for replica in candidates
        }

    def adapter_load(self, replica: ReplicaLoad, adapter: str) -> float:
        """What ``adapter`` adds to the replica's ``load`` (module docstring), in prompt tokens."""
        fit = self.adapters_sent.fit(adapter, replica.replica_id, replica.adapters, replica.max_loras)
        return fit.price(self.config.adapter_load_tokens, self.config.adapter_wait_tokens)

    def routed(self, replica_id: str) -> float:
        """The recent requests sent ``replica_id``, as the relative bound counts them."""
        return self.recent.requests(replica_id)

    def routed_limit(self, candidates: Sequence[ReplicaLoad]) -> float:
        """The most recent requests a candidate may have been sent and stay within bounds."""
        if self.config.max_routed_ratio is None or len(candidates) < 2:
            return math.inf
        least = min(self.routed(replica.replica_id) for replica in candidates)
        return self.config.max_routed_ratio * least + ROUTED_SLACK

    def is_overloaded(self, replica: ReplicaLoad, routed_limit: float = math.inf) -> bool:
        """Whether ``replica`` is over any bound; ``routed_limit`` comes from ``routed_limit``."""
        config = self.config
        queued_bound = config.max_queued_prefill_tokens
        if queued_bound is not None and replica.queued_prefill_tokens > queued_bound:
            return True
        if config.max_active_requests is not None and replica.num_active_requests > config.max_active_requests:
            return True
        if config.max_kv_usage is not None and replica.kv_usage > config.max_kv_usage:
            return True
        return self.routed(replica.replica_id) > routed_limit

    def choose(
        self, block_hashes: Sequence[bytes], num_prompt_tokens: int, candidates: Sequence[ReplicaLoad],
        adapter: str | None = None,
    ) -> RoutingDecision:
        """The candidate of lowest cost among those within bounds.

        ``block_hashes`` are the prompt's chained block hashes (from its
        adapter's root); ``adapter`` its LoRA adapter's name, None for the base
        model. Changes nothing: call ``record_routed`` once the request is sent.
        """
        if not candidates:
            raise ValueError("no candidate replicas")
        config = self.config
        runs = self.index.match_tiers(block_hashes, [replica.replica_id for replica in candidates])
        loads = self.loads(candidates)
        if adapter is not None:
            for replica in candidates:
                loads[replica.replica_id] += self.adapter_load(replica, adapter)
        routed_limit = self.routed_limit(candidates)
        scored = []
        for replica in candidates:
            run = runs.get(replica.replica_id)
            # No block held: what ``valued_tokens`` answers for an empty run, without the call.
            matched, valued = valued_tokens(run, self.hit_values, config.block_size, num_prompt_tokens) \
                if run else (0, 0.0)
            cost = config.w_prefix * (num_prompt_tokens - valued) + config.w_load * loads[replica.replica_id]
            scored.append(Scored(replica.replica_id, self.is_overloaded(replica, routed_limit), cost, matched, valued))
        return decide(scored, num_prompt_tokens, self._rng, adapter)

    def record_routed(self, decision: RoutingDecision, block_hashes: Sequence[bytes]) -> None:
        """The request went to ``decision.replica_id``, which will hold its blocks (optimistic insertion).

        If it landed elsewhere, pass ``dataclasses.replace(decision, replica_id=...)``.
        """
        self.index.insert(decision.replica_id, block_hashes, held=self._known_run(decision.replica_id, block_hashes),
                          prompt=True)
        self.recent.record(decision.replica_id, decision.uncached_tokens)
        unreported = self._unreported_prefill_tokens
        unreported[decision.replica_id] = unreported.get(decision.replica_id, 0) + decision.uncached_tokens
        self.adapters_sent.sent(decision.replica_id, decision.adapter)
        self.reason_counts[decision.reason] += 1

    def _known_run(self, replica_id: str, block_hashes: Sequence[bytes]) -> int | None:
        """``replica_id``'s run of ``block_hashes`` as the last decision matched it, while the index is unchanged
        since; None when that decision did not match it, or was about another prompt."""
        if self._matched is None:
            return None
        hashes, version, asked, runs = self._matched
        if hashes is not block_hashes or version != self.index.version or replica_id not in asked:
            return None
        return len(runs.get(replica_id, ()))

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica that left the pool."""
        self.index.remove_replica(replica_id)
        self.recent.remove(replica_id)
        self._unreported_prefill_tokens.pop(replica_id, None)
        self.adapters_sent.reported(replica_id)
