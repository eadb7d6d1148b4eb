"""Predicted-latency placement: each candidate's time to first token for this prompt, in seconds.

    ttft(r)  = wait(r) + adapter_wait(r) + compute(r)
    cost(r)  = ttft(r) + w_compute * compute(r) + w_follow * new * inflow(r) * marginal(r) + adapter_reload(r)
               + w_cached_s * written / max_num_batched_tokens * cached(r) / most cached
               (discounted for exploration, below)

``compute(r)`` is this prompt's prefill on ``r``: the tokens ``r`` does not
hold (a block in a slower tier counts as ``router.tiers`` values it), in
chunks of the engines' ``max_num_batched_tokens``, each chunk's step also
carrying the decodes ``r`` reported running. ``wait(r)`` is the prompt work
queued ahead of it: the replica's reported backlog (prompt tokens not yet
computed, and their query-key pairs) priced the same way when its report
came, less the time since, plus what this router sent it after. A request
still waiting there is reported as the prompt after the prefix its
admission will find cached (``pd.engine.reports.load_shape``).

Both are priced by the project's one step cost model (``router.step_cost``),
fitted online: every report carries the replica's cumulative step sums,
whose growth since its last report is decayed into

- the pool's fit: least squares over every replica's recent steps;
- each replica's speed: its recent measured seconds over what the pool's
  fit says its own steps should have taken. A replica that slows down
  (a noisy neighbour, a throttled CPU) is priced slower within a few
  half-lives, and one that recovers, faster again.

``adapter_wait(r)`` and ``adapter_reload(r)`` are what the request's LoRA
adapter takes there (``router.adapters``), 0 for the base model or where
``r`` holds it:

    a free slot:      adapter_wait = adapter_load_s                  the copy, before its first step
                      adapter_reload = 0
    every slot held:  adapter_wait = adapter_load_s + slot_wait(r)   the copy, after a slot frees
                      adapter_reload = adapter_load_s                the evicted adapter's next copy

``slot_wait(r)`` is ``PolicyConfig.adapter_wait_tokens`` (the token cost's
price of the wait) priced as ``r``'s prefill of that many tokens.
``adapter_reload`` is capacity taken from a later request, as ``w_compute`` is.

``w_compute`` charges the prefill's compute once more, beyond its own wait:
it is capacity taken from every later request, and a prefix recomputed on a
second replica copies it into a second cache. Without it a fast replica
with an empty queue would take every prompt whose holder has any queue.

**Exploration.** A replica whose speed was not measured lately (it got no
work, so ran no step) has its cost discounted by up to ``explore_fraction``
as its last measurement ages over ``explore_after_s``: enough for it to win
a near tie and be measured again, never enough to take work from a replica
clearly better.

**Before data.** Until the pool's fit has ``min_steps`` (decayed) steps,
and with no ``prior`` coefficients, ``PrefixAffinityPolicy``'s token cost
decides; such a decision has no ``predicted_s``.

**Candidates.** A decision scores a few replicas, not the pool
(``router.candidates``): those holding the prompt's longest cached prefix
and ``num_sampled`` drawn at random, so it costs the same at 16 replicas as
at 1,000.

**No balance bound.** The least predicted cost wins, wherever its queue
is: a replica that holds a hot tenant's history keeps taking its turns
while recomputing them elsewhere would take longer than waiting there, and
its queue, priced in seconds, is what moves the next one off. A bound on
requests per replica (``router.policy``'s ``max_routed_ratio``) moved long
histories off the replica holding them to even out counts; each such move
recomputed tens of thousands of tokens (``python -m bench.router_matrix``).
The absolute overload bounds (``PolicyConfig``: queued tokens, active
requests, KV usage) still pass a replica over.

**Where the cache is.** ``w_cached_s`` (5 ms per ``max_num_batched_tokens``
the prompt writes, its uncached tokens) is charged the candidate whose
cache the index says holds the most blocks, the others in proportion: a
tie-break among replicas predicted within a few milliseconds of each
other. It sends a long prompt nobody holds (a new session, a document)
where the fewest cached prefixes are, which is where the fewest later
requests will follow (Ray's prefix router sends a cold prompt to its
smallest tenant for the same reason). Without it two long sessions
started on one idle replica and their turns then queued behind each
other (``bench.router_matrix``, long histories); charged whatever the
prompt's size, it piled 100-token prompts onto the replicas holding
nothing, where their decodes slowed each other.

**Where work keeps arriving.** ``w_follow`` (3) charges a prompt its
marginal prefill (``marginal(r)``: its own tokens', pairs' and sampled row's
terms, without the constant and the decodes of the steps it rides in) once
more for each unit of the candidate's recent inflow (``router.inflow``: the
prefill seconds sent there per second, decayed over ``follow_half_life_s``),
which is, for the most part, what its cached sessions keep bringing, times
``new``: the share of the prompt that no candidate holds. A long prompt
nobody holds, which starts a session, then goes where the least work keeps
arriving, which keeps long sessions apart;
a turn of a cached session is mostly held, so it stays with its history;
a prompt behind a shared system prompt is charged for its own text only.
Before it a new session could start beside a long one, and a burst of one's
turns then queued the other's (``bench.router_matrix``: TTFT p99 1.03x Ray's
router's on long histories at 90% load, 1.02x on multi-tenant at 50%; with
it 1.005x and 0.994x). Charged on the whole prefill, steps' constant
included, it pushed 100-token prompts off every replica taking long ones
onto the few that took none, whose steps then carried more decodes: their
TTFT p50 was 1.058x the best policy's among 30k-token prompts at 75% load;
on the marginal prefill, 1.002x.

**Decodes sent.** In a colocated pool (``decodes_here``) each request
sent also decodes there after its prefill, slowing every step until the
replica's next report says so: the prediction counts it from the send.
Without it short prompts all went to the same few replicas between reports
(TTFT p50 1.2x the balanced router's, 100-token prompts among 30k-token ones).

**The guard** is for what the predictor cannot see. Within one report
interval a router sees its own sends (``record_routed`` queues each behind
the replica's reported backlog), so a burst it routes spreads as the
queues it builds grow. It cannot see the other ingress replicas' sends
until the next report: with ``num_ingress`` of them, each charges what it
sends as if each of the others had sent the same replica as much (the
worst case, that they all read the same report the same way; the random
sample keeps them from it in the common case). With one ingress, there is
no guard at all.

Pure Python and numpy, no Ray; not thread-safe (a router calls it from its
one event loop).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from router.adapters import AdapterFit
from router.candidates import sample_candidates
from router.latency_predictor import LatencyPolicyConfig, LatencyPredictor, Prediction, prefill_seconds
from router.policy import (
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoutingDecision,
    Scored,
    decide,
)
from router.protocol import RoutingStats
from router.step_cost import prefill_pairs

# The predictor's names, imported from here by the routers, the simulator and the ingress.
__all__ = ["LatencyPolicyConfig", "LatencyPredictor", "PredictedLatencyPolicy", "Prediction", "prefill_seconds"]


class PredictedLatencyPolicy(PrefixAffinityPolicy):
    """Chooses the prefill replica of least predicted time to first token (module docstring)."""

    def __init__(self, config: LatencyPolicyConfig, index=None) -> None:
        super().__init__(config, index)
        self.config: LatencyPolicyConfig = config
        self.predictor = LatencyPredictor(config)

    def observe(self, replica_id: str, stats: RoutingStats, now_s: float) -> None:
        """A new report from ``replica_id``, at ``now_s``."""
        self.reported(replica_id)
        self.predictor.observe(replica_id, stats, now_s)

    def choose(self, block_hashes: Sequence[bytes], num_prompt_tokens: int, candidates: Sequence[ReplicaLoad],
               now_s: float = 0.0, adapter: str | None = None) -> RoutingDecision:
        """The scored candidate of least predicted cost, of a few (``router.candidates``); before data,
        ``PrefixAffinityPolicy``'s over all. ``adapter``: the request's LoRA adapter, by name; None for the
        base model. ``ranked_replica_ids`` holds the scored ones only."""
        if not candidates:
            raise ValueError("no candidate replicas")
        predictor, config = self.predictor, self.config
        if not predictor.ready():
            return super().choose(block_hashes, num_prompt_tokens, candidates, adapter)
        scored_loads = sample_candidates(self.index, block_hashes, candidates, config.num_sampled,
                                         config.max_prefix_candidates, self._rng, adapter)
        asked = [replica.replica_id for replica in scored_loads]
        runs = self.index.match_tiers(block_hashes, asked)
        self._matched = (block_hashes, self.index.version, set(asked), runs)  # record_routed's insert reads it
        estimates = predictor.estimates(asked, runs, num_prompt_tokens, now_s)
        new_share = 1.0 - max(estimate[0] for estimate in estimates) / max(1, num_prompt_tokens)
        w_follow, w_compute = config.w_follow * new_share, config.w_compute
        inflow, measured_s, is_overloaded = predictor.inflow.fraction, predictor.fit.measured_s, self.is_overloaded
        explore_fraction, explore_after_s = config.explore_fraction, config.explore_after_s
        cached = [self.index.num_blocks(replica_id) for replica_id in asked] if config.w_cached_s else ()
        most_cached, chunk_tokens = max(cached, default=0) or 1, config.max_num_batched_tokens
        scored, ttfts = [], {}
        for position, (replica, (matched, valued, compute, ttft, marginal)) in enumerate(zip(scored_loads, estimates)):
            replica_id = replica.replica_id
            cost = ttft + w_compute * compute + w_follow * inflow(replica_id, now_s) * marginal
            if cached:
                written = (num_prompt_tokens - matched) / chunk_tokens
                cost += config.w_cached_s * written * cached[position] / most_cached
            if adapter is not None:
                adapter_wait, adapter_reload = self.adapter_seconds(replica, adapter)
                ttft += adapter_wait
                cost += adapter_wait + adapter_reload
            ttfts[replica_id] = ttft
            cost *= 1.0 - explore_fraction * min(1.0, (now_s - measured_s(replica_id)) / explore_after_s)
            scored.append(Scored(replica_id, is_overloaded(replica), cost, matched, valued))
        decision = decide(scored, num_prompt_tokens, self._rng, adapter)
        return dataclasses.replace(decision, predicted_s=ttfts[decision.replica_id])

    def adapter_seconds(self, replica: ReplicaLoad, adapter: str) -> tuple[float, float]:
        """``(adapter_wait, adapter_reload)`` of ``adapter`` on ``replica`` (module docstring), in seconds."""
        fit = self.adapters_sent.fit(adapter, replica.replica_id, replica.adapters, replica.max_loras)
        if fit is AdapterFit.HELD:
            return 0.0, 0.0
        load_s = self.config.adapter_load_s
        if fit is AdapterFit.LOAD:
            return load_s, 0.0
        wait_s = self.predictor.compute_s(replica.replica_id, self.config.adapter_wait_tokens, 0.0)
        return load_s + wait_s, load_s

    def record_routed(self, decision: RoutingDecision, block_hashes: Sequence[bytes], now_s: float = 0.0) -> None:
        super().record_routed(decision, block_hashes)
        self.predictor.sent(decision.replica_id, decision.uncached_tokens,
                            prefill_pairs(decision.uncached_tokens, decision.matched_tokens), now_s)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.predictor.forget(replica_id)
