"""Decode placement: KV headroom and few active decodes, plus a bonus for the prompt blocks a replica holds.

A decision scores a few candidates (``DecodePolicy.candidates``, as prefill routing does:
``router.candidates``): the replicas holding the prompt's longest prefix, those holding its LoRA adapter,
and ``num_sampled`` drawn at random. A pool of at most ``num_sampled`` is scored whole, so a decision costs
the same at 16 replicas and at 1,000.

A held block need not be pulled from the prefill replica; one in a slower
tier is valued as ``router.policy`` values it for prefill (``router.tiers``).
A request under a LoRA adapter prefers a replica holding it in a device slot
(``router.adapters``).
The lowest cost wins, within bounds, as ``router.policy.decide`` decides.
Pure Python, no Ray; not thread-safe (a router calls it from its one event loop).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from router.adapters import SentAdapters
from router.candidates import sample_candidates
from router.latency import LatencyPredictor
from router.policy import ReplicaLoad, RoutingDecision, RoutingReason, Scored, decide
from router.prefix_index import PrefixIndex
from router.recent import RecentRouted
from router.tiers import TierHitValues, valued_tokens


@dataclass(frozen=True)
class DecodePolicyConfig(TierHitValues):
    """Weights and bounds of decode placement; costs are in units of one active decode.

    ``block_size`` is the engines' (the app sets it from the engine config). A
    held block saves a pull from the prefill replica; one in a slower tier
    must be loaded instead, weighed by the ``*_hit_value`` fields: the
    defaults price a load against recomputing (``router.tiers``), which
    ranks the tiers as a pull would.
    """

    block_size: int
    w_active: float = 1.0  # per active request
    w_kv_usage: float = 8.0  # a full KV cache weighs like this many active requests
    w_prefix_hit: float = 2.0  # bonus for already holding the whole prompt, scaled by the fraction held
    # Per request this router sent a replica recently, beyond the least-sent candidate's: reports
    # come once a period, and without this a burst would all follow the last one to the same replica.
    w_recent: float = 1.0
    # A LoRA adapter's copy into a device slot: it stalls the replica's decodes for about one step's time.
    w_adapter_load: float = 1.0
    # Waiting for a slot where every one is held, and the churn of one more adapter there (``router.adapters``).
    w_adapter_wait: float = 4.0
    recent_window: int = 64  # decisions over which "recent" decays by 1/e
    max_kv_usage: float | None = 0.95
    max_active_requests: int | None = None
    index_max_blocks: int = 1 << 20  # (block hash, replica) entries in the decode pool's prefix index
    max_num_batched_tokens: int = 8192  # the engines' (the app sets it): a local prefill's chunk
    num_sampled: int = 16  # replicas drawn at random per decision; a pool this small is scored whole
    max_prefix_candidates: int = 8  # of the replicas holding the prompt's longest prefix (or its adapter)
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.index_max_blocks < 1:
            raise ValueError(f"index_max_blocks must be >= 1, got {self.index_max_blocks}")
        if self.recent_window < 1:
            raise ValueError(f"recent_window must be >= 1, got {self.recent_window}")
        if self.num_sampled < 1:
            raise ValueError(f"num_sampled must be >= 1, got {self.num_sampled}")
        if self.max_prefix_candidates < 0:
            raise ValueError(f"max_prefix_candidates must be >= 0, got {self.max_prefix_candidates}")
        for name in ("w_active", "w_kv_usage", "w_prefix_hit", "w_recent", "w_adapter_load",
                     "w_adapter_wait"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_kv_usage is not None and not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage must be in (0, 1] or None, got {self.max_kv_usage}")
        if self.max_active_requests is not None and self.max_active_requests < 1:
            raise ValueError(f"max_active_requests must be >= 1 or None, got {self.max_active_requests}")


class DecodePolicy:
    """Chooses the decode replica: KV headroom and few active decodes, plus a bonus for its own prefix hits.

        cost(r) = w_active * active(r) + w_kv_usage * kv_usage
                  + w_recent * (recent_requests(r) - least)
                  - w_prefix_hit * valued_matched_tokens / num_prompt_tokens
                  + adapter(r)

        adapter(r) = 0                                    no adapter, or r holds it (``router.adapters``)
                   = w_adapter_load                       a free slot: one copy of its weights
                   = 2 * w_adapter_load + w_adapter_wait  every slot held: the copy, the evicted
                                                          adapter's next copy, and the wait for a slot

    ``active(r)`` is ``num_active_requests``; with a ``predictor`` that has
    data (``router.latency``), it is the predicted impact on inter-token
    latency instead, in decodes: how much longer than a lone decode of this
    request on a replica of the pool's speed the step ``r`` would run with
    this request among its decodes, at its measured speed, over what one more
    such decode adds to a step. On replicas of the pool's speed whose decodes
    attend as much as this one, that is ``num_active_requests``; a slower
    replica, or one whose decodes attend longer contexts, counts heavier.
    """

    def __init__(self, config: DecodePolicyConfig, predictor: LatencyPredictor | None = None) -> None:
        self.config = config
        self.predictor = predictor
        self.hit_values = config.hit_values()
        self.recent = RecentRouted(config.recent_window)
        self.reason_counts: Counter[RoutingReason] = Counter()
        self._rng = random.Random(config.seed)
        self.adapters_sent = SentAdapters()

    def reported(self, replica_id: str) -> None:
        """A new report from ``replica_id``: the adapters it holds are in it."""
        self.adapters_sent.reported(replica_id)

    def candidates(self, index: PrefixIndex, block_hashes: Sequence[bytes], replicas: Sequence[ReplicaLoad],
                   adapter: str | None = None) -> list[ReplicaLoad]:
        """The replicas a decision scores (module docstring): ``index`` is the decode pool's prefix index."""
        config = self.config
        return sample_candidates(index, block_hashes, replicas, config.num_sampled, config.max_prefix_candidates,
                                 self._rng, adapter)

    def is_overloaded(self, replica: ReplicaLoad) -> bool:
        config = self.config
        if config.max_kv_usage is not None and replica.kv_usage > config.max_kv_usage:
            return True
        return config.max_active_requests is not None and replica.num_active_requests > config.max_active_requests

    def choose(
        self, candidates: Sequence[ReplicaLoad], matches: Mapping[str, int | Sequence[int]], num_prompt_tokens: int,
        adapter: str | None = None,
    ) -> RoutingDecision:
        """The candidate of lowest cost among those within bounds.

        ``matches`` maps replica id to its leading run of the prompt's blocks
        in the decode pool's index: the tier of each block
        (``PrefixIndex.match_tiers``), or a count of device blocks
        (``PrefixIndex.match``). Absent means none. ``adapter``: the request's
        LoRA adapter, by name; None for the base model.
        """
        if not candidates:
            raise ValueError("no candidate replicas")
        config = self.config
        # One pass over the candidates (``candidates``' few, or a whole pool), each a few float operations.
        recent = self.recent.requests_of([replica.replica_id for replica in candidates])
        least_recent = min(recent)
        w_active, w_kv_usage, w_recent, w_prefix_hit = (config.w_active, config.w_kv_usage, config.w_recent,
                                                        config.w_prefix_hit)
        active = self._active(candidates, num_prompt_tokens)
        scored = []
        for replica, recent_requests, active_r in zip(candidates, recent, active):
            run = matches.get(replica.replica_id)
            if run:
                matched, valued = valued_tokens(run, self.hit_values, config.block_size, num_prompt_tokens)
                hit_fraction = valued / num_prompt_tokens if num_prompt_tokens > 0 else 0.0
            else:  # no block held: what ``valued_tokens`` answers for an empty run
                matched, valued, hit_fraction = 0, 0.0, 0.0
            cost = (
                w_active * active_r
                + w_kv_usage * replica.kv_usage
                + w_recent * (recent_requests - least_recent)
                - w_prefix_hit * hit_fraction
            )
            if adapter is not None:
                cost += self._adapter_cost(replica, adapter)
            scored.append(Scored(replica.replica_id, self.is_overloaded(replica), cost, matched, valued))
        return decide(scored, num_prompt_tokens, self._rng, adapter)

    def _adapter_cost(self, replica: ReplicaLoad, adapter: str) -> float:
        """``adapter(r)`` of the class docstring, in active decodes."""
        fit = self.adapters_sent.fit(adapter, replica.replica_id, replica.adapters, replica.max_loras)
        return fit.price(self.config.w_adapter_load, self.config.w_adapter_wait)

    def _active(self, candidates: Sequence[ReplicaLoad], num_prompt_tokens: int) -> list[float]:
        """Each candidate's active requests, or their predicted weight on its steps (class docstring).

        A decode step of b sequences on replica r, whose decodes attend to c tokens, takes
        speed(r) * (base + (per_token + per_seq + per_sample) * b + per_pair * c): written out over the
        candidates.
        """
        predictor = self.predictor
        if predictor is None or not predictor.ready():
            return [replica.num_active_requests for replica in candidates]
        base, per_token, per_pair, per_seq, per_sample = predictor.fit.coefficients()
        per_decode = per_token + per_seq + per_sample
        one_more = per_decode + per_pair * num_prompt_tokens  # what one more such decode adds to a step
        if one_more <= 0:
            return [replica.num_active_requests for replica in candidates]
        lone = base + one_more
        speed, context = predictor.fit.speed, predictor.decode_context
        return [(speed(replica.replica_id) * (base + per_decode * (replica.num_active_requests + 1) + per_pair
                                              * (context(replica.replica_id) + num_prompt_tokens)) - lone) / one_more
                for replica in candidates]

    def record_routed(self, decision: RoutingDecision) -> None:
        """Count the decision once the request is sent."""
        self.recent.record(decision.replica_id, 0)
        self.adapters_sent.sent(decision.replica_id, decision.adapter)
        self.reason_counts[decision.reason] += 1
