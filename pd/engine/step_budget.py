"""Stall-free batching (Sarathi-Serve's): while decodes run, a prompt chunk is cut to an inter-token budget.

A step that carries decode rows is every running stream's next inter-token
gap. ``max_num_batched_tokens`` bounds a step in tokens, and a 2,048-token
chunk beside three streams is seconds of their gap on a CPU. With
``itl_target_s`` the scheduler asks this budget how much of a prompt chunk
fits: the largest chunk that keeps the step's predicted time within the
target, priced by the engine's own fit of the step cost model
(``router.step_cost``: the law the routers predict its latency by).

Per step, ``begin`` prices the step's decode rows (every running request
with one token to compute) and keeps what the target leaves; ``cap`` then
gives each prompt chunk, in the order the scheduler meets them, the most of
its tokens that the rest pays for, none once it is spent. A step without
decode rows is not limited (no stream waits on it), and the step's first
prompt chunk gets ``min_chunk`` tokens at least, so prompts advance however
busy the step (the others wait: eight prompts arriving together are not
eight chunks beside the streams). Until the fit has seen ``MIN_FIT_STEPS``
steps, only that first chunk runs beside decodes.

**Priority bands.** With ``low_priority_s``, a step whose first prompt
chunk is less urgent than priority 0 (vLLM's ``priority``: a batch band) is
limited to that time as well, decodes or not: an urgent prompt arriving
meanwhile waits for the step in flight, and a 2,048-token step of batch
prompts is seconds on a CPU. The scheduler keeps less urgent prompts out of
a step that computes an urgent one, so a step's first prompt chunk is its
most urgent. Until the fit has its steps, such a step is priced by the
seconds per token of the steps so far (a prefill replica steps seldom: on
2 cores its first eight steps of 512-token prompts took 40 s); before any
step, it is not limited.

The inter-token target protects the streams at least as urgent as the
step's first prompt: beside batch streams alone an urgent prompt is not
cut, so a batch job's stream never holds an urgent request's first token
back (it waits one longer step instead, as vLLM's priority policy would
preempt it).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from pd.engine.request import Request
from router.step_cost import StepSums, fit_linear, gram_matrix

# Steps recorded before the fit is trusted; the fit is refreshed every REFIT_STEPS steps.
MIN_FIT_STEPS = 8
REFIT_STEPS = 16


class StepBudget:
    """The prompt tokens a step may compute beside its decodes (module docstring)."""

    def __init__(self, target_s: float | None = None, sums: StepSums | None = None, min_chunk: int = 1,
                 low_priority_s: float | None = None):
        """``target_s`` None: no step is limited for its decodes (``max_num_batched_tokens`` alone bounds it);
        ``low_priority_s`` None: none for its prompts' priority."""
        for name, value in (("itl_target_s", target_s), ("low_priority_step_s", low_priority_s)):
            if value is not None and (value <= 0 or sums is None):
                raise ValueError(f"{name} must be > 0 and priced by a step fit, got {value}")
        self.target_s, self.low_priority_s = target_s, low_priority_s
        self.sums = sums
        self.min_chunk = max(1, min_chunk)
        self.coefficients: np.ndarray | None = None
        self._fitted_at = -REFIT_STEPS
        self._left_s: float | None = None  # None: this step is not limited
        self._rows_s: float | None = None  # the step's fixed cost and decode rows, once there is a fit
        self._itl_left_s: float | None = None  # what the inter-token target leaves the prompts (None: no streams)
        self._streams_priority = 0  # the most urgent stream's priority
        self._granted = False  # a prompt chunk has its tokens in this step

    def begin(self, running: Sequence[Request]) -> None:
        """A new step over ``running``: price its decode rows and keep what the target leaves."""
        self._granted, self._left_s, self._rows_s, self._itl_left_s = False, None, None, None
        if self.target_s is None and self.low_priority_s is None:
            return
        decodes = [r for r in running if r.num_tokens_with_unread - r.num_scheduled_tokens == 1]
        if not decodes and self.low_priority_s is None:
            return
        coefficients = self._fit()
        young = coefficients is None
        if young and self.low_priority_s is not None:
            coefficients = self._proportional()
        if coefficients is not None:
            base, per_token, per_pair, per_seq, per_sample = coefficients
            pairs = sum(r.num_computed_tokens + 1 for r in decodes)
            self._rows_s = base + (per_token + per_seq + per_sample) * len(decodes) + per_pair * pairs
        if decodes and self.target_s is not None:
            # No fit yet: only the smallest chunk beside streams.
            self._itl_left_s = 0.0 if young else self.target_s - self._rows_s
            self._streams_priority = min(r.priority for r in decodes)

    def cap(self, num_new: int, num_computed: int, scored: bool = False, priority: int = 0) -> int:
        """How many of a chunk's ``num_new`` tokens (after ``num_computed``) fit; the time is spent. A decode's one
        token always does. ``scored``: the request scores its prompt, so each token is a logits row too.
        ``priority``: the request's; the step's first prompt chunk less urgent than 0 limits the step."""
        if num_new <= 1:
            return num_new
        if not self._granted:
            self._left_s = self._limit_s(priority)
        if self._left_s is None:
            self._granted = True
            return num_new
        fits = self._largest(num_computed, scored) if self._left_s > 0 and self.coefficients is not None else 0
        chunk = min(num_new, max(0 if self._granted else self.min_chunk, fits))
        if chunk:
            self._granted = True
            self._left_s -= self._chunk_s(chunk, num_computed, scored)
        return chunk

    def _limit_s(self, priority: int) -> float | None:
        """The time a step led by a prompt chunk of ``priority`` leaves its prompts (None: not limited). The
        inter-token target protects the streams at least as urgent as the prompt; the batch bound, a step of
        prompts less urgent than 0."""
        limits = []
        if self._itl_left_s is not None and priority >= self._streams_priority:
            limits.append(self._itl_left_s)
        if priority > 0 and self.low_priority_s is not None and self._rows_s is not None:
            limits.append(self.low_priority_s - self._rows_s)
        return min(limits) if limits else None

    def _largest(self, c: int, scored: bool) -> int:
        """The largest n whose chunk cost (``_chunk_s``) is within the time left: the quadratic's root."""
        _, a, b, s, m = self.coefficients
        budget = self._left_s - s - m
        if budget <= 0:
            return 0
        linear = a + b * (c + 0.5) + (max(m, 0.0) if scored else 0.0)
        if b <= 0:
            return int(budget / linear) if linear > 0 else 1 << 30
        half = b / 2  # cost(n) = half * n^2 + linear * n: the pairs n*c + n(n+1)/2 at per_pair b
        return int((-linear + math.sqrt(linear * linear + 4 * half * budget)) / (2 * half))

    def _chunk_s(self, n: int, c: int, scored: bool = False) -> float:
        if self.coefficients is None:
            return 0.0
        _, a, b, s, m = self.coefficients
        return a * n + b * (n * c + n * (n + 1) / 2) + s + m + (max(m, 0.0) * n if scored else 0.0)

    def _proportional(self) -> np.ndarray | None:
        """Before the fit: every second of the steps so far charged to their tokens (for the batch bound; a
        step's fixed cost counted per token prices a chunk high, so it errs short). None before any step."""
        steps_s, tokens = self.sums.moments[0], self.sums.gram[1]
        if tokens <= 0:
            return None
        self.coefficients = np.array([0.0, steps_s / tokens, 0.0, 0.0, 0.0])
        return self.coefficients

    def _fit(self) -> np.ndarray | None:
        steps = self.sums.gram[0]  # the count of steps recorded
        if steps < MIN_FIT_STEPS:
            return None
        if steps - self._fitted_at >= REFIT_STEPS or self.coefficients is None:
            self.coefficients = fit_linear(gram_matrix(self.sums.gram), np.asarray(self.sums.moments))
            self._fitted_at = steps
        return self.coefficients
