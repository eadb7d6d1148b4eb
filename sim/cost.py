"""The modelled forward pass: an engine step's time from the shape of its batch.

A step's batch is what the real scheduler put in it. Its shape (tokens,
attended pairs, sequences, sampled rows) and the linear law of its time are
``router.step_cost``'s: the one cost model, which the engine and the routers
share (the routers fit it online to predict latency).

Dense layers scale with tokens, attention with pairs (decode reads the
whole context once per new token: n = 1, c = context), the rest with
sequences. ``fit`` finds the coefficients from measured steps (least squares,
none negative); ``python -m sim.profile`` measures them on the real engine.

A mixture of experts adds one term that is not linear (``ExpertReads``):
each MoE layer reads the weights of every expert the step's tokens were
routed to, once, and T tokens touch E * (1 - (1 - k/E)^T) of its E experts
(top-k routing, uniform): k for a one-token decode, all E for a long
prefill. Its price is analytic (``sim.hardware``); ``fit`` fits the linear
terms only, so a profile measured on an MoE model folds its expert reads
into them at the batch sizes it measured.

A replica over several GPUs (expert parallelism, ``sim.expert_parallel``) is
priced on its slowest rank: ``ExpertReads`` counts the experts of that rank,
and ``Collectives`` adds the traffic between the ranks (all-to-alls and
all-reduces), linear in the step's tokens and sampled rows plus a latency
per collective.

Multi-head latent attention prices a decode's pair apart (``decode_pair_s``):
a prompt attends decompressed and a decode absorbed, at different costs a
pair. A step's shape does not say which of its pairs are whose, so a step
whose every sequence computes one token takes the decode price, and any
other the prompt's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from router.step_cost import FEATURES, StepShape, StepSums, fit_linear, gram_matrix  # noqa: F401  (FEATURES, StepShape: re-exported)


@dataclass(frozen=True)
class ExpertReads:
    """An MoE model's expert weights a step reads: every expert its tokens were routed to, once per MoE layer.

    Each token picks ``top_k`` distinct experts of ``num_experts``; with
    uniform, independent routing an expert escapes one token with
    probability 1 - k/E, so T tokens touch E * (1 - (1 - k/E)^T) experts
    of a layer on average: exactly k at T = 1, approaching E (never above)
    as T grows. Real routing is skewed, which touches fewer; uniform is the
    bound a deployment plans for.
    """

    num_layers: int  # the MoE layers (a dense layer's MLP weights are in ``CostModel.base_s``)
    num_experts: int
    top_k: int
    per_expert_s: float  # reading one expert's weights of one layer
    # Expert parallelism: the ranks the experts are spread over (E / num_ranks logical experts each), and
    # the placement's balancedness, mean over max tokens per rank (pd.engine.ep.placement.balancedness):
    # the busiest rank's expert work is the mean rank's over it. 1.0 is perfectly balanced, as uniform
    # routing is in expectation; a caller with a measured placement gives its figure.
    num_ranks: int = 1
    balancedness: float = 1.0

    def __post_init__(self) -> None:
        if self.num_layers < 0 or self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"an MoE needs num_layers >= 0 and 1 <= top_k <= num_experts, got {self}")
        if self.per_expert_s < 0:
            raise ValueError(f"per_expert_s must be >= 0, got {self.per_expert_s}")
        if self.num_ranks < 1 or not 0 < self.balancedness <= 1:
            raise ValueError(f"num_ranks must be >= 1 and balancedness in (0, 1], got {self.num_ranks} and "
                             f"{self.balancedness}")

    def distinct_experts(self, num_tokens: int) -> float:
        """The experts of one layer that ``num_tokens`` tokens touch, in expectation."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def rank_experts(self, num_tokens: int) -> float:
        """The experts of one layer that ``num_tokens`` tokens touch on one rank: (E / ranks)(1 - (1 - k/E)^T)."""
        return self.num_experts / self.num_ranks * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def seconds(self, num_tokens: int) -> float:
        """The busiest rank's expert reads (the whole replica's with one rank)."""
        return self.num_layers * self.rank_experts(num_tokens) * self.per_expert_s / self.balancedness


@dataclass(frozen=True)
class Collectives:
    """What a replica's ranks exchange in one step, on the rank that waits longest: bytes over its link
    plus a fixed latency per collective (``sim.expert_parallel`` counts them for a layout).

    Every collective of a step is linear in its tokens (each token's activations, all-to-all or
    all-reduced) or its sampled rows (the logits gathered to rank 0), so a step of T tokens and S
    sampled rows takes

        num_collectives * latency_s + (T * bytes_per_token + S * bytes_per_sample) / link_bytes_per_s
    """

    num_collectives: int  # per step, every layer's together
    bytes_per_token: float  # a rank sends, per token of the step
    bytes_per_sample: float  # rank 0 receives, per sampled row
    link_bytes_per_s: float  # one GPU's link, one direction
    latency_s: float  # per collective

    def __post_init__(self) -> None:
        if (self.num_collectives < 0 or self.bytes_per_token < 0 or self.bytes_per_sample < 0
                or self.link_bytes_per_s <= 0 or self.latency_s < 0):
            raise ValueError(f"collectives need counts, bytes and latency >= 0 and a link > 0: {self}")

    def seconds(self, num_tokens: int, num_samples: int) -> float:
        return (self.num_collectives * self.latency_s
                + (num_tokens * self.bytes_per_token + num_samples * self.bytes_per_sample) / self.link_bytes_per_s)


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
    # An MoE model's expert weights read per step (not linear in the tokens); None for a dense model.
    experts: ExpertReads | None = None
    # A replica over several GPUs: what its ranks exchange each step; None for one GPU.
    collectives: Collectives | None = None
    # The price of a pair in a step whose every sequence computes one token, where a decode attends
    # another way than a prompt (multi-head latent attention: absorbed, against decompressed); None:
    # ``per_pair_s`` in every step.
    decode_pair_s: float | None = None

    def __post_init__(self) -> None:
        negative = [name for name, value in asdict(self).items()
                    if name not in ("source", "experts", "collectives") and value is not None and value < 0]
        if negative:
            raise ValueError(f"cost coefficients must be >= 0: {', '.join(negative)}")

    def pair_seconds(self, shape: StepShape) -> float:
        """The price of one of ``shape``'s pairs: ``decode_pair_s`` where every sequence computes one token."""
        if self.decode_pair_s is not None and shape.num_tokens == shape.num_seqs:
            return self.decode_pair_s
        return self.per_pair_s

    def step_seconds(self, shape: StepShape) -> float:
        # ``vector()``'s terms summed in its order, written out: it runs once per simulated step.
        seconds = (0.0 + self.base_s + self.per_token_s * shape.num_tokens + self.pair_seconds(shape) * shape.attn_pairs
                   + self.per_seq_s * shape.num_seqs + self.per_sample_s * shape.num_samples)
        if self.experts is not None:
            seconds += self.experts.seconds(shape.num_tokens)
        if self.collectives is not None:
            seconds += self.collectives.seconds(shape.num_tokens, shape.num_samples)
        return seconds

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float], source: str) -> CostModel:
        """Least squares over measured steps, with no coefficient negative (a negative one is dropped, and
        refit): ``router.step_cost.fit_linear``, as the routers fit the same law online.

        The linear terms only: the result has no ``experts``, ``collectives`` or ``decode_pair_s`` term.
        """
        if len(shapes) != len(seconds) or not shapes:
            raise ValueError(f"need as many step times as shapes, and some: got {len(shapes)} and {len(seconds)}")
        sums = StepSums()
        for shape, step_s in zip(shapes, seconds):
            sums.record(shape, float(step_s))
        coefficients = fit_linear(gram_matrix(sums.gram), np.array(sums.moments))
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
        """A profile ``to_json`` wrote; one written before MoE pricing (no ``experts``) is a dense one."""
        fields = json.loads(Path(path).read_text())
        experts = fields.pop("experts", None)
        collectives = fields.pop("collectives", None)
        return cls(**fields, experts=ExpertReads(**experts) if experts is not None else None,
                   collectives=Collectives(**collectives) if collectives is not None else None)
