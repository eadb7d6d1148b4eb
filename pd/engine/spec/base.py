"""What proposes draft tokens: the ``Proposer`` protocol the lookup methods implement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (the request's prompt, then its output so far).

        ``token_ids`` only grows between calls for one request. [] when nothing matches.
        """

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended: drop what was kept for it (a shared cache may keep its output)."""


def make_proposer(config) -> Proposer:
    """The proposer of ``config.method`` (a ``pd.engine.spec.config.SpeculativeConfig``)."""
    if config.method == "ngram":
        from pd.engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from pd.engine.spec.suffix import SuffixProposer

        return SuffixProposer(max_depth=config.suffix_max_depth, max_cached_tokens=config.suffix_cache_tokens,
                              max_spec_factor=config.suffix_max_spec_factor,
                              min_token_prob=config.suffix_min_token_prob)
    raise ValueError(f"speculative_config.method {config.method!r} has no lookup proposer: the engine builds a "
                     "draft model's (pd.engine.spec.draft)")
