"""Per-request sampling settings."""

from __future__ import annotations

import msgspec

# Temperatures below this are sampled greedily, as vLLM does: dividing logits by
# them overflows to inf, and the distribution is an argmax to within fp32 anyway.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop.

    ``temperature=0`` (or below ``GREEDY_TEMPERATURE``) is greedy; ``top_k=None`` means no top-k; ``seed`` makes a
    sampled request reproducible whatever else is in the batch. ``logprobs``
    asks for the log-probability of each sampled token (any value >= 0).
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
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied (and checked)."""
        return msgspec.structs.replace(self, **changes)
