"""Two trace shapes built to break a prefix-affinity router, in the Mooncake format (``pd.workload.trace``).

- **Flash crowd** (``generate_flash_crowd``): multi-tenant chat, and in a
  window of it one tenant's users all arrive at once, each prompt that
  tenant's long context plus their own text. Pinning the tenant to the
  replica holding its context piles the crowd into one queue; spreading it
  too soon recomputes the context on every replica.
- **Long and short** (``generate_long_short``): 100-token prompts nobody
  shares, among 30k-token ones that re-read a few long documents. A short
  prompt queued behind a long prefill waits for all of it; a long one sent
  away from its document's holder recomputes 30k tokens.

Token ranges are inclusive (min, max), drawn uniformly; ids are the trace's
512-token blocks, fresh for text nobody else sends.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from pd.workload.trace import TRACE_BLOCK_TOKENS, MultiTenantTraceConfig, TraceRequest, generate_multi_tenant


class _Ids:
    """Fresh block ids from ``first``; a prompt's ids: its shared prefix's full blocks, then fresh ones."""

    def __init__(self, first: int) -> None:
        self.next_id = first

    def fresh(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids

    def prompt(self, prefix_ids: list[int], prefix_len: int, prompt_len: int) -> tuple[int, ...]:
        shared = prefix_ids[: prefix_len // TRACE_BLOCK_TOKENS]
        return tuple(shared + self.fresh(math.ceil(prompt_len / TRACE_BLOCK_TOKENS) - len(shared)))


@dataclass(frozen=True)
class FlashCrowdTraceConfig:
    """``crowd_share`` of the requests are one tenant's, arriving in ``window`` (start and end, as fractions of
    the background's span), over ``background`` traffic (its ``num_requests``, ``rate_per_s`` and ``seed``
    set from this config's)."""

    num_requests: int = 2000
    rate_per_s: float = 10.0
    crowd_share: float = 0.2
    window: tuple[float, float] = (0.4, 0.65)
    context_tokens: int = 8192  # the crowd's tenant's context
    user_tokens: tuple[int, int] = (64, 768)
    output_tokens: tuple[int, int] = (64, 512)
    background: MultiTenantTraceConfig = MultiTenantTraceConfig()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 2 or self.rate_per_s <= 0 or not 0 < self.crowd_share < 1:
            raise ValueError("num_requests must be >= 2, rate_per_s > 0, crowd_share in (0, 1)")
        if not 0 <= self.window[0] < self.window[1] <= 1:
            raise ValueError(f"window must be 0 <= start < end <= 1, got {self.window}")


def generate_flash_crowd(config: FlashCrowdTraceConfig = FlashCrowdTraceConfig()) -> list[TraceRequest]:
    """Background multi-tenant turns with one tenant's crowd merged in, in arrival order."""
    num_crowd = int(config.num_requests * config.crowd_share)
    background = generate_multi_tenant(dataclasses.replace(
        config.background, num_requests=config.num_requests - num_crowd,
        rate_per_s=config.rate_per_s * (1 - config.crowd_share), seed=config.seed))
    rng = random.Random(f"{config.seed}:flash-crowd")
    ids = _Ids(1 + max(block_id for request in background for block_id in request.hash_ids))
    context = ids.fresh(config.context_tokens // TRACE_BLOCK_TOKENS)
    span_ms = background[-1].timestamp_ms
    start_ms, end_ms = (fraction * span_ms for fraction in config.window)
    crowd = []
    for timestamp_ms in sorted(rng.uniform(start_ms, end_ms) for _ in range(num_crowd)):
        prompt_len = config.context_tokens + rng.randint(*config.user_tokens)
        crowd.append(TraceRequest(int(timestamp_ms), prompt_len, rng.randint(*config.output_tokens),
                                  ids.prompt(context, config.context_tokens, prompt_len)))
    return sorted(background + crowd, key=lambda request: request.timestamp_ms)


@dataclass(frozen=True)
class LongShortTraceConfig:
    """Poisson arrivals; ``long_share`` of them a Zipf-popular one of ``num_documents`` documents of
    ``document_tokens`` plus a question, the rest ``short_tokens`` of their own."""

    num_requests: int = 2000
    rate_per_s: float = 10.0
    long_share: float = 0.1
    num_documents: int = 16
    zipf_s: float = 1.0
    document_tokens: int = 30_000
    question_tokens: tuple[int, int] = (32, 256)
    short_tokens: tuple[int, int] = (100, 100)
    output_tokens: tuple[int, int] = (32, 256)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate_per_s <= 0 or not 0 < self.long_share < 1 or self.num_documents < 1:
            raise ValueError("num_requests, rate_per_s and num_documents must be positive, long_share in (0, 1)")


def generate_long_short(config: LongShortTraceConfig = LongShortTraceConfig()) -> list[TraceRequest]:
    """Short prompts of their own among long ones over a few shared documents, Poisson arrivals."""
    rng = random.Random(config.seed)
    ids = _Ids(0)
    documents = [ids.fresh(config.document_tokens // TRACE_BLOCK_TOKENS) for _ in range(config.num_documents)]
    popularity = [1.0 / (rank + 1) ** config.zipf_s for rank in range(config.num_documents)]
    requests, now_s = [], 0.0
    for _ in range(config.num_requests):
        now_s += rng.expovariate(config.rate_per_s)
        if rng.random() < config.long_share:
            document = rng.choices(documents, weights=popularity)[0]
            prompt_len = config.document_tokens + rng.randint(*config.question_tokens)
            prompt_ids = ids.prompt(document, config.document_tokens, prompt_len)
        else:
            prompt_len = rng.randint(*config.short_tokens)
            prompt_ids = ids.prompt([], 0, prompt_len)
        requests.append(TraceRequest(int(now_s * 1000), prompt_len, rng.randint(*config.output_tokens), prompt_ids))
    return requests
