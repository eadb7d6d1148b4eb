"""One request's time on one engine, as the engine reports it with the request's first token.

It crosses processes inside prefill results and decode chunks, and the ingress
reads it into the request's timeline and trace, so this module imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pd.engine.request import Request


@dataclass(frozen=True)
class EngineTimings:
    """Where one request's time went on one engine, up to its first token out of it.

    ``queue_s``: arrival to first admission. ``first_token_s``: first admission
    to the first token this engine produced, including a KV pull
    (``pull_s``; a decode engine after a remote prefill produces the request's
    second token first).
    """

    queue_s: float
    first_token_s: float
    pull_s: float = 0.0
    num_pulled_bytes: int = 0
    num_pulled_blocks: int = 0
    num_pull_descriptors: int = 0
    pull_error: str = ""
    num_cached_tokens: int = 0
    num_prompt_chunks: int = 0
    num_preemptions: int = 0

    @classmethod
    def first_of(cls, request: Request) -> "EngineTimings | None":
        """``request``'s timings, on its first output with a token (None on later ones)."""
        if request.first_token_time is not None:
            return None
        request.first_token_time = now = time.monotonic()
        return cls(queue_s=request.queue_seconds, first_token_s=now - (request.first_scheduled_time or now),
                   pull_s=request.pull_seconds, num_pulled_bytes=request.num_pulled_bytes,
                   num_pulled_blocks=request.num_pulled_blocks, num_pull_descriptors=request.num_pull_descriptors,
                   pull_error=request.pull_error, num_cached_tokens=request.num_cached_tokens,
                   num_prompt_chunks=request.num_prompt_chunks, num_preemptions=request.num_preemptions)
