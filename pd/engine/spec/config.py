"""``SpeculativeConfig``: which draft method a decode step verifies, and how many tokens it may propose.

Configured as vLLM's ``speculative_config`` is: ``LLM(model, speculative_config={...})``,
``EngineConfig(speculative_config=...)`` or the YAML's ``engine: {speculative_config: {...}}``.
A dict is checked here, an unknown key or method named.

Methods:

- ``ngram``: prompt lookup. The longest n-gram (``prompt_lookup_min`` to
  ``prompt_lookup_max`` tokens) ending the sequence, found earlier in the
  request's prompt or output; its continuation is the draft.
- ``draft_model``: a smaller checkpoint (``model``) with the target's
  vocabulary drafts greedily, run by the engine's own code with a KV pool of
  its own (``pd.engine.spec.draft``).
- ``suffix``: suffix decoding. The request's own tokens and a bounded cache
  of the replica's recent outputs (``suffix_cache_tokens`` tokens), matched by
  their longest common suffix, the continuation chosen by frequency.

Every method's drafts are verified by the target's own draws
(``pd.engine.spec.verify``): outputs are the non-speculative engine's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

SPEC_METHODS = ("ngram", "suffix", "draft_model")
SpecMethod = Literal[SPEC_METHODS]
# The most draft tokens one verify step may carry per request.
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    # The YAML edge names an unknown key. A plain dict (pydantic's ConfigDict is a TypedDict): the engine
    # imports no pydantic, which the GPU machine lacks.
    __pydantic_config__ = {"extra": "forbid"}

    method: SpecMethod = "ngram"
    num_speculative_tokens: int = 4
    # draft_model: the draft's checkpoint (as EngineConfig.model), sharing the target's vocabulary.
    model: str | None = None
    # ngram: the shortest and longest n-gram matched.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # suffix: the longest suffix matched; the shared cache's size in tokens (its memory bound);
    # a draft is at most max_spec_factor x the match length; a continuation token is kept while
    # at least min_token_prob of the matches agree on it.
    suffix_max_depth: int = 24
    suffix_cache_tokens: int = 65536
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    # False: every draft found is verified, at any load (for measuring the back-off's worth).
    backoff: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft checkpoint of method draft_model, and only "
                             f"of it: got method {self.method!r} with model {self.model!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.suffix_max_depth < 1 or self.suffix_cache_tokens < 0:
            raise ValueError("speculative_config.suffix_max_depth must be >= 1 and suffix_cache_tokens >= 0, got "
                             f"{self.suffix_max_depth} and {self.suffix_cache_tokens}")
        if self.suffix_max_spec_factor <= 0 or not 0 <= self.suffix_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_max_spec_factor must be > 0 and suffix_min_token_prob in "
                             f"[0, 1], got {self.suffix_max_spec_factor} and {self.suffix_min_token_prob}")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """``value`` as a config: a dict's keys checked (an unknown one named), None kept."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a method, one of {SPEC_METHODS}")
        return cls(**value)
