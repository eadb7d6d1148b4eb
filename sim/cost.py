"""The modelled forward pass: an engine step's time from the shape of its batch.

A step's batch is what the real scheduler put in it. Its shape is four numbers:

    num_tokens   tokens computed (every new token of every request)
    attn_pairs   query-key pairs attended: a chunk of n new tokens after c
                 computed ones attends to c + 1 .. c + n keys, n * c + n * (n + 1) / 2
    num_seqs     requests in the step (per-sequence work: sampling, metadata, a decode's KV read setup)
    num_samples  logits rows (the LM head and the sampler)

and the step's time is linear in them:

    t = base_s + per_token_s * num_tokens + per_pair_s * attn_pairs
        + per_seq_s * num_seqs + per_sample_s * num_samples

Dense layers scale with tokens, attention with pairs (decode reads the
whole context once per new token: n = 1, c = context), the rest with
sequences. ``fit`` finds the coefficients from measured steps (least squares,
none negative); ``python -m sim.profile`` measures them on the real engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from pd.engine.outputs import ScheduledRequest

FEATURES = ("num_tokens", "attn_pairs", "num_seqs", "num_samples")


@dataclass(frozen=True)
class StepShape:
    num_tokens: int
    attn_pairs: int
    num_seqs: int
    num_samples: int

    @classmethod
    def of(cls, scheduled: Sequence[ScheduledRequest]) -> StepShape:
        """The shape of a scheduler's output, before its update (``num_computed_tokens`` not yet advanced)."""
        tokens = pairs = samples = 0
        for item in scheduled:  # one pass: every simulated step of every replica comes through here
            n, c = item.num_new_tokens, item.request.num_computed_tokens
            tokens += n
            pairs += n * c + n * (n + 1) // 2
            samples += item.samples
        return cls(num_tokens=tokens, attn_pairs=pairs, num_seqs=len(scheduled), num_samples=samples)

    def vector(self) -> list[float]:
        return [1.0, *(float(getattr(self, name)) for name in FEATURES)]


@dataclass(frozen=True)
class CostModel:
    """Seconds per step; ``source`` says whether it was measured (and on what) or is analytic."""

    base_s: float
    per_token_s: float
    per_pair_s: float
    per_seq_s: float
    per_sample_s: float
    source: str = "analytic"
    # Seconds per byte copied between the device pool and its host tier (promotions, demotions), added
    # to the step that copies them; 0 in profiles measured on CPU, where the two are the same memory.
    per_host_byte_s: float = 0.0

    def __post_init__(self) -> None:
        negative = [name for name, value in asdict(self).items() if name != "source" and value < 0]
        if negative:
            raise ValueError(f"cost coefficients must be >= 0: {', '.join(negative)}")

    def step_seconds(self, shape: StepShape) -> float:
        # ``vector()``'s terms summed in its order, written out: it runs once per simulated step.
        return (0.0 + self.base_s + self.per_token_s * shape.num_tokens + self.per_pair_s * shape.attn_pairs
                + self.per_seq_s * shape.num_seqs + self.per_sample_s * shape.num_samples)

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float], source: str) -> CostModel:
        """Least squares over measured steps, with no coefficient negative (a negative one is dropped, and refit)."""
        if len(shapes) != len(seconds) or not shapes:
            raise ValueError(f"need as many step times as shapes, and some: got {len(shapes)} and {len(seconds)}")
        x = np.array([shape.vector() for shape in shapes])
        y = np.array(seconds, dtype=float)
        active = list(range(x.shape[1]))
        while True:
            solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (solution >= 0).all():
                break
            del active[int(np.argmin(solution))]
        coefficients = np.zeros(x.shape[1])
        coefficients[active] = solution
        return cls(*map(float, coefficients), source=source)

    def with_overhead(self, step_s: float, sample_s: float, why: str) -> CostModel:
        """``step_s`` more on every step and ``sample_s`` on every sampled token (work the profile does not see, and why)."""
        if step_s < 0 or sample_s < 0:
            raise ValueError(f"a step's overheads must be >= 0, got step_s={step_s} and sample_s={sample_s}")
        return replace(self, base_s=self.base_s + step_s, per_sample_s=self.per_sample_s + sample_s,
                       source=f"{self.source}; +{step_s * 1000:.3g} ms a step, +{sample_s * 1000:.3g} ms a token: {why}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls(**json.loads(Path(path).read_text()))
