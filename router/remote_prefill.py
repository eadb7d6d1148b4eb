"""The ingress's rule for where a prompt is prefilled: on the prefill pool, or on its decode replica.

Pure, so the simulator runs it as the ingress does:

    remote  iff  num_prompt_tokens > threshold
            and  uncached_tokens   > threshold + threshold_per_in_flight * prefill_in_flight
            and  prefill_in_flight < queue_bound

``uncached_tokens`` is what the decode replica would compute itself (the
decode pool's prefix index says how much of the prompt it holds): a prompt
the decode pool already holds is prefilled there even when it is long. A
positive ``threshold_per_in_flight`` raises the bar as the prefill pool
fills, so short prompts stay local when remote prefill would queue.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemotePrefillRule:
    threshold: int = 256  # uncached prompt tokens at or below which the decode replica prefills
    queue_bound: int = 32  # prefill calls in flight from this ingress at which the pool counts as saturated
    threshold_per_in_flight: float = 0.0  # tokens added to the threshold per prefill call in flight

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.queue_bound < 1:
            raise ValueError(f"queue_bound must be >= 1, got {self.queue_bound}")
        if self.threshold_per_in_flight < 0:
            raise ValueError(f"threshold_per_in_flight must be >= 0, got {self.threshold_per_in_flight}")

    def may_go_remote(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt is long enough to consider at all (before looking up what is cached)."""
        return num_prompt_tokens > self.threshold

    def wants_remote(self, num_prompt_tokens: int, uncached_tokens: int, prefill_in_flight: int) -> bool:
        if not self.may_go_remote(num_prompt_tokens) or prefill_in_flight >= self.queue_bound:
            return False
        return uncached_tokens > self.threshold + self.threshold_per_in_flight * prefill_in_flight
