"""Per-request sampling settings."""

from __future__ import annotations

import enum

import msgspec

# Temperatures below this are sampled greedily, as vLLM does: dividing logits by
# them overflows to inf, and the distribution is an argmax to within fp32 anyway.
GREEDY_TEMPERATURE = 1e-5
# The most alternatives a request may ask for per position (OpenAI's bound for top_logprobs).
MAX_TOP_LOGPROBS = 20
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for drawing the token at ``position`` of a request seeded ``seed``
    (splitmix64 of the pair): the engine's sampler reseeds with it for every draw, and the ingress
    derives each choice's seed with it."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class StructuredKind(enum.Enum):
    """What a structured-output constraint's ``spec`` holds."""

    JSON_OBJECT = "json_object"  # any JSON object; ``spec`` is empty
    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    REGEX = "regex"  # a regular expression the whole output matches
    CHOICE = "choice"  # a JSON array of strings: the output is exactly one of them


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A grammar the output must follow; the engine masks every token that would leave it."""

    kind: StructuredKind
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop.

    ``temperature=0`` (or below ``GREEDY_TEMPERATURE``) is greedy; ``top_k=None`` means no top-k; ``seed`` makes a
    sampled request reproducible whatever else is in the batch. ``logprobs=k``
    asks for the log-probability of each sampled token and of the ``k`` most
    likely tokens at its position (``k=0``: the sampled token's alone);
    ``prompt_logprobs=k`` the same for every prompt token after the first.
    Log-probabilities are the model's own (log-softmax of the raw logits),
    before temperature, top-k/top-p and any grammar mask. ``structured``
    constrains the output to a grammar.
    A msgspec struct: it crosses processes inside pool requests, decoded as
    strictly as every other wire message.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}] or None, got {value}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied (and checked)."""
        return msgspec.structs.replace(self, **changes)
