"""What the predicted-latency router (``router.latency``) knows of each replica's queue, and its prediction.

``LatencyPredictor`` keeps, per replica, when its known prompt work ends
(its report's backlog, priced by the step cost fit, plus what this router
sent since), its decodes, and the prompt tokens queued there; it prices a
prompt's prefill there and the time to its first token. The policy that
chooses by it, and why each term is there, is ``router.latency``; the
decode router and the remote-prefill rule read the same predictor.

Pure Python and numpy, no Ray; not thread-safe (a router calls it from its
one event loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from router.inflow import Inflow
from router.policy import PolicyConfig
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
    # Prefill seconds charged per second of it times the replica's recent inflow (``router.inflow``), decayed
    # over follow_half_life_s: what its cached sessions keep bringing.
    w_follow: float = 3.0
    follow_half_life_s: float = 30.0
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
        for name in ("half_life_s", "explore_after_s", "follow_half_life_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_steps", "min_replica_steps", "w_compute", "w_follow", "adapter_load_s", "w_cached_s"):
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
    return steps * per_step + _marginal_s(coefficients, tokens, pairs)


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
        self.inflow = Inflow(config.follow_half_life_s)

    def best(self, runs, num_prompt_tokens: int, replica_ids: Sequence[str], now_s: float) -> Prediction | None:
        """The replica of least predicted time to first token; None before data or with no replica.

        ``runs`` are the pool index's leading runs of the prompt's blocks (``PrefixIndex.match_tiers``).
        """
        if not replica_ids or not self.ready():
            return None
        best = None
        estimates = self.estimates(replica_ids, runs, num_prompt_tokens, now_s)
        for replica_id, (matched, _, compute, ttft, _) in zip(replica_ids, estimates):
            if best is None or ttft < best.ttft_s:
                queue = self._queues.get(replica_id)
                best = Prediction(replica_id, ttft, compute, queue.decoding if queue else 0, matched)
        return best

    def estimate(self, replica_id: str, run, num_prompt_tokens: int, now_s: float) -> tuple[int, float, float, float]:
        """``(matched, valued, compute_s, ttft_s)`` of a prompt on ``replica_id``, whose leading run of the
        prompt's blocks is ``run``: the tokens it holds; those valued by their tier and the chance they
        survive the work queued ahead; the prefill of the rest; and that prefill after the wait."""
        return self.estimates((replica_id,), {replica_id: run} if run else {}, num_prompt_tokens, now_s)[0][:4]

    def estimates(self, replica_ids: Sequence[str], runs, num_prompt_tokens: int,
                  now_s: float) -> list[tuple[int, float, float, float, float]]:
        """``estimate``'s four for each of ``replica_ids`` (``runs``: their leading runs, by id, as
        ``PrefixIndex.match_tiers`` gives them), then ``marginal_s`` of the prefill's tokens and pairs: what
        one decision scores, with the fit's coefficients read once. Before data (not ``ready``), raises."""
        coefficients = self.fit.coefficients()
        hit_values, block_size = self.hit_values, self.config.block_size
        chunk_tokens = self.config.max_num_batched_tokens
        queues, speed_of = self._queues, self.fit.speed
        out = []
        for replica_id in replica_ids:
            run, queue = runs.get(replica_id), queues.get(replica_id) or _NO_QUEUE
            matched, valued = valued_tokens(run, hit_values, block_size, num_prompt_tokens) if run else (0, 0.0)
            if matched:
                valued *= _survival(queue, block_size)
            tokens, pairs = num_prompt_tokens - valued, prefill_pairs(num_prompt_tokens - matched, matched)
            speed = speed_of(replica_id)
            compute = speed * prefill_seconds(coefficients, tokens, pairs, queue.decoding, queue.decode_context,
                                              chunk_tokens)
            out.append((matched, valued, compute, max(0.0, queue.busy_until_s - now_s) + compute,
                        speed * _marginal_s(coefficients, tokens, pairs)))
        return out

    def ready(self) -> bool:
        return self.fit.coefficients() is not None

    def compute_s(self, replica_id: str, tokens: float, pairs: float) -> float:
        """Seconds ``replica_id`` takes to prefill ``tokens`` more, with its reported decodes alongside."""
        coefficients = self.fit.coefficients()
        queue = self._queues.get(replica_id) or _NO_QUEUE
        return self.fit.speed(replica_id) * prefill_seconds(
            coefficients, tokens, pairs, queue.decoding, queue.decode_context, self.config.max_num_batched_tokens)

    def marginal_s(self, replica_id: str, tokens: float, pairs: float) -> float:
        """What ``tokens`` more (attending ``pairs``) add to the steps ``replica_id`` runs anyway: their own
        terms, without the steps' constant and decodes."""
        return self.fit.speed(replica_id) * _marginal_s(self.fit.coefficients(), tokens, pairs)

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
        tokens, pairs = stats.num_waiting_tokens, stats.num_waiting_pairs  # after the prefixes they will find
        queue.tokens_ahead, queue.free_blocks = tokens, stats.num_free_blocks
        queue.busy_until_s = now_s + (self.compute_s(replica_id, tokens, pairs) if self.ready() else 0.0)

    def sent(self, replica_id: str, tokens: float, pairs: float, now_s: float) -> None:
        """This router sent ``replica_id`` a prompt of that much uncomputed work: it queues behind the rest."""
        unseen = self.config.num_ingress  # the guard: the other ingresses' sends, as many as this one's
        if not self.ready():
            return
        queue = self._queues.setdefault(replica_id, _Queue())
        compute_s = unseen * self.compute_s(replica_id, tokens, pairs)
        queue.busy_until_s = max(queue.busy_until_s, now_s) + compute_s
        self.inflow.sent(replica_id, compute_s, now_s)
        queue.tokens_ahead += int(unseen * tokens)
        if self.config.decodes_here:
            queue.decoding += unseen

    def survival(self, replica_id: str) -> float:
        """The chance a cached prefix there is still cached when a prompt sent now starts (``_survival``)."""
        return _survival(self._queues.get(replica_id) or _NO_QUEUE, self.config.block_size)

    def forget(self, replica_id: str) -> None:
        self.fit.forget(replica_id)
        self.transfer.forget(replica_id)
        self._queues.pop(replica_id, None)
        self.inflow.forget(replica_id)


_NO_QUEUE = _Queue()  # a replica not reported yet: nothing queued, no decodes (read, never written)


def _marginal_s(coefficients: Sequence[float], tokens: float, pairs: float) -> float:
    """A prefill's own terms of the step law at a speed of 1: no constant, no decodes (``marginal_s``)."""
    _, per_token, per_pair, _, per_sample = coefficients
    return per_token * tokens + per_pair * pairs + per_sample


def _survival(queue: _Queue, block_size: int) -> float:
    """The chance a cached prefix is still cached when a prompt sent now starts there.

    Cached blocks nobody uses sit in the free queue, oldest first, and
    every block allocated takes the oldest: the work queued ahead takes
    ``tokens_ahead / block_size`` of the ``free_blocks``. With the prefix
    anywhere in the queue, it survives with 1 - taken / free.
    """
    if queue.free_blocks is None or queue.tokens_ahead <= 0:
        return 1.0
    return max(0.0, 1.0 - queue.tokens_ahead / block_size / queue.free_blocks) if queue.free_blocks > 0 else 0.0
