"""Predicted-latency placement: each candidate's time to first token for this prompt, in seconds.

    ttft(r)  = wait(r) + adapter_wait(r) + compute(r)
    cost(r)  = ttft(r) + w_compute * compute(r) + adapter_reload(r)
               + w_cached_s * written / max_num_batched_tokens * cached(r) / most cached
               (discounted for exploration, below)

``compute(r)`` is this prompt's prefill on ``r``: the tokens ``r`` does not
hold (a block in a slower tier counts as ``router.tiers`` values it), in
chunks of the engines' ``max_num_batched_tokens``, each chunk's step also
carrying the decodes ``r`` reported running. ``wait(r)`` is the prompt work
queued ahead of it: the replica's reported backlog (prompt tokens not yet
computed, and their query-key pairs) priced the same way when its report
came, less the time since, plus what this router sent it after.

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
import math
from dataclasses import dataclass
from typing import Sequence

from router.adapters import AdapterFit
from router.candidates import sample_candidates
from router.policy import (
    PolicyConfig,
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoutingDecision,
    Scored,
    decide,
)
from router.protocol import RoutingStats
from router.step_cost import NUM_TERMS, prefill_pairs
from router.step_fit import StepCostFit, TransferFit
from router.tiers import valued_tokens


@dataclass(frozen=True)
class LatencyPolicyConfig(PolicyConfig):
    """``PolicyConfig``'s bounds and tier values, and what predicting latency needs.

    ``max_num_batched_tokens`` is the engines' (the app sets it from the engine config).
    """

    max_num_batched_tokens: int = 8192
    half_life_s: float = 30.0  # step sums halve in weight over this (how fast a speed change is followed)
    min_steps: float = 32.0  # the pool's recent steps before its fit is trusted
    min_replica_steps: float = 8.0  # a replica's recent steps before its speed is its own (the pool's until then)
    w_compute: float = 1.0  # prefill compute seconds charged beyond the request's own wait
    # The candidates a decision scores (``router.candidates``): a random few, and the most prefix holders.
    num_sampled: int = 8
    max_prefix_candidates: int = 4
    # Seconds charged the candidate holding the most cached blocks, the others in proportion (module docstring).
    w_cached_s: float = 0.005
    # Whether a request decodes where it was prefilled (a colocated pool), so that each one sent adds a decode to
    # that replica's steps until its next report; False for a prefill pool, whose requests decode elsewhere.
    decodes_here: bool = False
    # The guard (module docstring): ingress replicas each routing into this pool; each assumes the others sent
    # a replica, since its last report, what it did itself.
    num_ingress: int = 1
    explore_fraction: float = 0.1  # the most a stale replica's cost is discounted
    explore_after_s: float = 30.0  # the age of a replica's last measurement at which the discount is whole
    # A LoRA adapter's copy into a device slot, in seconds (a rank-16 adapter of an 8B model, 84 MB, over PCIe 4).
    adapter_load_s: float = 0.004
    # Step cost coefficients (base, per token, per pair, per seq, per sample) before the fit has data; None: none.
    prior: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_num_batched_tokens", "num_sampled", "num_ingress"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefix_candidates < 0:
            raise ValueError(f"max_prefix_candidates must be >= 0, got {self.max_prefix_candidates}")
        for name in ("half_life_s", "explore_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_steps", "min_replica_steps", "w_compute", "adapter_load_s", "w_cached_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.explore_fraction < 1.0:
            raise ValueError(f"explore_fraction must be in [0, 1), got {self.explore_fraction}")
        if self.prior is not None and (len(self.prior) != NUM_TERMS or min(self.prior) < 0):
            raise ValueError(f"prior needs {NUM_TERMS} coefficients, none negative; got {self.prior}")


def prefill_seconds(coefficients: Sequence[float], tokens: float, pairs: float, decoding: int, decode_context: int,
                    chunk_tokens: int) -> float:
    """Prefill of ``tokens`` (attending ``pairs``) in chunks, each step also carrying ``decoding`` decodes.

    Per step: the constant, one sequence per decode and one for the chunk,
    and each decode's token, sample and context; then the prompt's tokens and
    pairs once, and its one sampled row.
    """
    if tokens <= 0:
        return 0.0
    base, per_token, per_pair, per_seq, per_sample = coefficients
    steps = math.ceil(tokens / max(1, chunk_tokens - decoding))
    per_step = (base + per_seq * (decoding + 1) + (per_token + per_sample) * decoding + per_pair * decode_context)
    return steps * per_step + per_token * tokens + per_pair * pairs + per_sample


@dataclass
class _Queue:
    """What a router knows of one replica's queue: when its known prompt work ends, and its decodes."""

    busy_until_s: float = 0.0
    decoding: int = 0
    decode_context: int = 0
    tokens_ahead: int = 0  # prompt tokens queued there: reported, and sent since
    free_blocks: int | None = None  # free blocks, cached ones among them, as reported


@dataclass(frozen=True)
class Prediction:
    """A pool's best replica for a prompt: least predicted time to first token (``LatencyPredictor.best``)."""

    replica_id: str
    ttft_s: float  # its wait and the prefill
    compute_s: float  # the prefill alone
    num_decoding: int  # decodes running there, which a prefill there would slow
    matched_tokens: int  # prompt tokens it holds


class LatencyPredictor:
    """Each replica's predicted prompt wait and compute, from its reports and this router's own sends."""

    def __init__(self, config: LatencyPolicyConfig) -> None:
        self.config = config
        self.fit = StepCostFit(config.half_life_s, config.min_steps, config.min_replica_steps, config.prior)
        self.transfer = TransferFit(config.half_life_s)
        self.hit_values = config.hit_values()
        self._queues: dict[str, _Queue] = {}

    def best(self, runs, num_prompt_tokens: int, replica_ids: Sequence[str], now_s: float) -> Prediction | None:
        """The replica of least predicted time to first token; None before data or with no replica.

        ``runs`` are the pool index's leading runs of the prompt's blocks (``PrefixIndex.match_tiers``).
        """
        if not replica_ids or not self.ready():
            return None
        best = None
        for replica_id in replica_ids:
            matched, _, compute, ttft = self.estimate(replica_id, runs.get(replica_id), num_prompt_tokens, now_s)
            if best is None or ttft < best.ttft_s:
                queue = self._queues.get(replica_id)
                best = Prediction(replica_id, ttft, compute, queue.decoding if queue else 0, matched)
        return best

    def estimate(self, replica_id: str, run, num_prompt_tokens: int, now_s: float) -> tuple[int, float, float, float]:
        """``(matched, valued, compute_s, ttft_s)`` of a prompt on ``replica_id``, whose leading run of the
        prompt's blocks is ``run``: the tokens it holds; those valued by their tier and the chance they
        survive the work queued ahead; the prefill of the rest; and that prefill after the wait."""
        matched, valued = valued_tokens(run, self.hit_values, self.config.block_size, num_prompt_tokens) \
            if run else (0, 0.0)
        if matched:
            valued *= self.survival(replica_id)
        compute = self.compute_s(replica_id, num_prompt_tokens - valued,
                                 prefill_pairs(num_prompt_tokens - matched, matched))
        return matched, valued, compute, self.wait_s(replica_id, now_s) + compute

    def ready(self) -> bool:
        return self.fit.coefficients() is not None

    def compute_s(self, replica_id: str, tokens: float, pairs: float) -> float:
        """Seconds ``replica_id`` takes to prefill ``tokens`` more, with its reported decodes alongside."""
        coefficients = self.fit.coefficients()
        queue = self._queues.get(replica_id) or _Queue()
        return self.fit.speed(replica_id) * prefill_seconds(
            coefficients, tokens, pairs, queue.decoding, queue.decode_context, self.config.max_num_batched_tokens)

    def decode_context(self, replica_id: str) -> int:
        """The tokens the replica's decodes attend to each step, as it last reported."""
        queue = self._queues.get(replica_id)
        return queue.decode_context if queue is not None else 0

    def wait_s(self, replica_id: str, now_s: float) -> float:
        queue = self._queues.get(replica_id)
        return max(0.0, queue.busy_until_s - now_s) if queue is not None else 0.0

    def observe(self, replica_id: str, stats: RoutingStats, now_s: float) -> None:
        """A replica's report: its fit, its decodes, and its backlog, which replaces what this router estimated."""
        self.fit.observe(replica_id, stats, now_s)
        self.transfer.observe(replica_id, stats, now_s)
        queue = self._queues.setdefault(replica_id, _Queue())
        queue.decoding, queue.decode_context = stats.num_decoding, stats.num_decode_context_tokens
        queue.tokens_ahead, queue.free_blocks = stats.num_waiting_tokens, stats.num_free_blocks
        backlog = self.compute_s(replica_id, stats.num_waiting_tokens, stats.num_waiting_pairs) if self.ready() else 0.0
        queue.busy_until_s = now_s + backlog

    def sent(self, replica_id: str, tokens: float, pairs: float, now_s: float) -> None:
        """This router sent ``replica_id`` a prompt of that much uncomputed work: it queues behind the rest."""
        if not self.ready():
            return
        unseen = self.config.num_ingress  # the guard: the other ingresses' sends, as many as this one's
        queue = self._queues.setdefault(replica_id, _Queue())
        queue.busy_until_s = max(queue.busy_until_s, now_s) + unseen * self.compute_s(replica_id, tokens, pairs)
        queue.tokens_ahead += int(unseen * tokens)
        if self.config.decodes_here:
            queue.decoding += unseen

    def survival(self, replica_id: str) -> float:
        """The chance a cached prefix there is still cached when a prompt sent now starts.

        Cached blocks nobody uses sit in the free queue, oldest first, and
        every block allocated takes the oldest: the work queued ahead takes
        ``tokens_ahead / block_size`` of the ``free_blocks``. With the prefix
        anywhere in the queue, it survives with 1 - taken / free.
        """
        queue = self._queues.get(replica_id)
        if queue is None or queue.free_blocks is None or queue.tokens_ahead <= 0:
            return 1.0
        taken = queue.tokens_ahead / self.config.block_size
        return max(0.0, 1.0 - taken / queue.free_blocks) if queue.free_blocks > 0 else 0.0

    def forget(self, replica_id: str) -> None:
        self.fit.forget(replica_id)
        self.transfer.forget(replica_id)
        self._queues.pop(replica_id, None)


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
        runs = self.index.match_tiers(block_hashes, [replica.replica_id for replica in scored_loads])
        scored, ttfts = [], {}
        cached = [self.index.num_blocks(replica.replica_id) for replica in scored_loads] if config.w_cached_s else ()
        most_cached = max(cached, default=0) or 1
        for position, replica in enumerate(scored_loads):
            replica_id = replica.replica_id
            matched, valued, compute, ttft = predictor.estimate(replica_id, runs.get(replica_id), num_prompt_tokens,
                                                                now_s)
            cost = ttft + config.w_compute * compute
            if cached:
                written = (num_prompt_tokens - matched) / config.max_num_batched_tokens
                cost += config.w_cached_s * written * cached[position] / most_cached
            if adapter is not None:
                adapter_wait, adapter_reload = self.adapter_seconds(replica, adapter)
                ttft += adapter_wait
                cost += adapter_wait + adapter_reload
            ttfts[replica_id] = ttft
            cost *= self._exploration(replica_id, now_s)
            scored.append(Scored(replica_id, self.is_overloaded(replica), cost, matched, valued))
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

    def _exploration(self, replica_id: str, now_s: float) -> float:
        age = now_s - self.predictor.fit.measured_s(replica_id)
        return 1.0 - self.config.explore_fraction * min(1.0, age / self.config.explore_after_s)

    def record_routed(self, decision: RoutingDecision, block_hashes: Sequence[bytes], now_s: float = 0.0) -> None:
        super().record_routed(decision, block_hashes)
        self.predictor.sent(decision.replica_id, decision.uncached_tokens,
                            prefill_pairs(decision.uncached_tokens, decision.matched_tokens), now_s)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.predictor.forget(replica_id)
