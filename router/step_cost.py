"""A step's cost model: its shape, the linear law of its time, and the running sums that fit it.

A step's batch is what the scheduler put in it. Its shape is four numbers:

    num_tokens   tokens computed (every new token of every request)
    attn_pairs   query-key pairs attended: a chunk of n new tokens after c
                 computed ones attends to c + 1 .. c + n keys, n * c + n * (n + 1) / 2
    num_seqs     requests in the step (per-sequence work: sampling, metadata, a decode's KV read setup)
    num_samples  logits rows (the LM head, and the sampler or a scored prompt token's top k)

and the step's time is linear in them:

    t = base_s + per_token_s * num_tokens + per_pair_s * attn_pairs
        + per_seq_s * num_seqs + per_sample_s * num_samples

This is the one cost model of the project, kept here because routing
policies import no engine. The simulator prices its steps
with it (``sim.cost.CostModel``); the engine keeps the sums that fit it to
its own steps (``StepSums``: the Gram matrix of the shapes and their
moments with the measured seconds), which its replica publishes in its
routing stats; and the router fits it from them, online
(``router.latency``), to predict each replica's latency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

FEATURES = ("num_tokens", "attn_pairs", "num_seqs", "num_samples")
NUM_TERMS = 1 + len(FEATURES)  # the constant, then the features
# The upper triangle of the terms' Gram matrix, row by row: what ``StepSums.gram`` holds.
GRAM_SIZE = NUM_TERMS * (NUM_TERMS + 1) // 2


def prefill_pairs(num_new_tokens: int, num_computed_tokens: int) -> int:
    """Query-key pairs of ``num_new_tokens`` computed after ``num_computed_tokens``."""
    n, c = num_new_tokens, num_computed_tokens
    return n * c + n * (n + 1) // 2


@dataclass(frozen=True)
class StepShape:
    num_tokens: int
    attn_pairs: int
    num_seqs: int
    num_samples: int

    @classmethod
    def of(cls, scheduled: Sequence[Any]) -> StepShape:
        """The shape of a scheduler's output (``pd.engine.outputs.ScheduledRequest``s), before its update
        (``num_computed_tokens`` not yet advanced)."""
        tokens = pairs = samples = 0
        for item in scheduled:  # one pass: every simulated step of every replica comes through here
            n, c = item.num_new_tokens, item.request.num_computed_tokens
            tokens += n
            pairs += n * c + n * (n + 1) // 2
            samples += item.num_logits_rows  # a verify chunk samples each draft; a scored prompt, each token
        return cls(num_tokens=tokens, attn_pairs=pairs, num_seqs=len(scheduled), num_samples=samples)

    def vector(self) -> list[float]:
        return [1.0, float(self.num_tokens), float(self.attn_pairs), float(self.num_seqs), float(self.num_samples)]


def linear_seconds(coefficients: Sequence[float], vector: Sequence[float]) -> float:
    """``coefficients`` (base, per token, per pair, per seq, per sample) applied to a shape's ``vector``."""
    return sum(c * x for c, x in zip(coefficients, vector))


@dataclass
class StepSums:
    """Cumulative sums over steps that fit the linear law by least squares: never reset.

    ``gram`` is the upper triangle of sum(x x^T) over the steps' vectors x
    (``StepShape.vector``), row by row; ``moments`` is sum(x * seconds).
    ``moments[0]`` is the steps' total time and ``gram[0]`` their count; the
    first row of the Gram matrix is the features' totals. A reader
    differences two reads for a period's sums, or decays them.
    """

    gram: list[float] = field(default_factory=lambda: [0.0] * GRAM_SIZE)
    moments: list[float] = field(default_factory=lambda: [0.0] * NUM_TERMS)

    def record(self, shape: StepShape, seconds: float) -> None:
        """Add one step: every simulated step of every replica comes through here, so the 15 products of the
        triangle are written out (a loop over them cost 4x as much); the constant term's are the features."""
        t, p, s, m = (float(shape.num_tokens), float(shape.attn_pairs), float(shape.num_seqs),
                      float(shape.num_samples))
        g = self.gram
        g[0] += 1.0
        g[1] += t
        g[2] += p
        g[3] += s
        g[4] += m
        g[5] += t * t
        g[6] += t * p
        g[7] += t * s
        g[8] += t * m
        g[9] += p * p
        g[10] += p * s
        g[11] += p * m
        g[12] += s * s
        g[13] += s * m
        g[14] += m * m
        moments = self.moments
        moments[0] += seconds
        moments[1] += t * seconds
        moments[2] += p * seconds
        moments[3] += s * seconds
        moments[4] += m * seconds


def gram_matrix(upper: Sequence[float]) -> np.ndarray:
    """The symmetric matrix of an upper triangle stored row by row (``StepSums.gram``)."""
    if len(upper) != GRAM_SIZE:
        raise ValueError(f"a step Gram triangle has {GRAM_SIZE} entries, got {len(upper)}")
    matrix = np.zeros((NUM_TERMS, NUM_TERMS))
    matrix[np.triu_indices(NUM_TERMS)] = upper
    return matrix + np.triu(matrix, 1).T


def fit_linear(gram: np.ndarray, moments: np.ndarray, ridge: float = 1e-9) -> np.ndarray | None:
    """Least-squares coefficients of the linear law from its normal equations, none negative.

    A negative coefficient is dropped (fixed at 0) and the rest refit, as
    ``sim.cost.CostModel.fit`` does. Each term is scaled by its root mean
    square first, and ``ridge`` (relative) keeps a term the steps never
    varied from making the system singular: such a term gets 0. None when
    no step was recorded.
    """
    if gram[0, 0] <= 0:
        return None
    scale = np.sqrt(np.maximum(np.diag(gram), 0.0))
    scale[scale == 0] = 1.0
    normal = gram / np.outer(scale, scale)
    rhs = moments / scale
    active = list(range(NUM_TERMS))
    solution = np.zeros(0)
    while active:
        sub = normal[np.ix_(active, active)] + ridge * np.eye(len(active))
        solution = np.linalg.solve(sub, rhs[active])
        if (solution >= 0).all():
            break
        del active[int(np.argmin(solution))]
    coefficients = np.zeros(NUM_TERMS)
    coefficients[active] = solution
    return coefficients / scale
