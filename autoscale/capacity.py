"""A replica's capacity from its own step times (``pd.engine.step_times``): what the planner calls ``Capacity``.

Prefill: prompt tokens computed over the seconds of the steps that computed
them. Decode: the least-squares line through (batch size, step time) of the
steps that computed no prompt token, ``t = decode_step_s + decode_step_per_seq_s * b``.
Each figure needs ``MIN_SECONDS`` of steps behind it; before that it is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MIN_SECONDS = 1.0


@dataclass(frozen=True)
class StepSums:
    """The cumulative step sums of one or more replicas (``EngineStats`` field names)."""

    num_computed_prompt_tokens: float = 0.0
    prefill_seconds: float = 0.0
    decode_steps: float = 0.0
    decode_seconds: float = 0.0
    decode_seqs: float = 0.0
    decode_seqs_sq: float = 0.0
    decode_seq_seconds: float = 0.0

    def __add__(self, other: StepSums) -> StepSums:
        return StepSums(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def prefill_tokens_per_s(sums: StepSums) -> float | None:
    if sums.prefill_seconds < MIN_SECONDS or sums.num_computed_prompt_tokens <= 0:
        return None
    return sums.num_computed_prompt_tokens / sums.prefill_seconds


def decode_step_line(sums: StepSums) -> tuple[float, float] | None:
    """``(decode_step_s, decode_step_per_seq_s)``, or None before enough decode steps.

    With every step at one batch size the line is not determined: the whole
    step is then charged per sequence (no fixed part), which overstates a
    larger batch's step and so errs towards more replicas.
    """
    n, sum_b, sum_t = sums.decode_steps, sums.decode_seqs, sums.decode_seconds
    if sum_t < MIN_SECONDS or sum_b <= 0:
        return None
    spread = n * sums.decode_seqs_sq - sum_b * sum_b
    if spread > 1e-9 * n * sums.decode_seqs_sq:
        slope = (n * sums.decode_seq_seconds - sum_b * sum_t) / spread
        intercept = (sum_t - slope * sum_b) / n
        if slope > 0 and intercept >= 0:
            return intercept, slope
    return 0.0, sum_t / sum_b
