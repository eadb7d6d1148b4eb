"""Typed hand-offs along one engine step.

    Request -> SchedulerOutput -> ForwardInput -> ForwardOutput -> RequestOutput

A step builds a ``ScheduledRequest`` and a ``RequestOutput`` for every request in
it, so those two are slotted, not frozen: a frozen dataclass sets each field
through ``object.__setattr__``, and at a batch of 256 that was a quarter of a
4 ms device step in host time (``bench.step_overhead``). Nothing changes them
after they are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.engine.request import FinishReason, KVSource, Request
from pd.engine.timings import EngineTimings
from pd.model.attention import AttentionMetadata


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this chunk reaches the request's last token, so its logits are sampled.
    samples: bool
    # Speculative decoding (``pd.engine.spec``): tokens proposed after the request's last, computed in this
    # chunk (counted in ``num_new_tokens``) and each verified by a logits row of its own.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_samples(self) -> int:
        """Logits rows this chunk samples: its last token's, and one per draft token."""
        return (1 + len(self.draft_token_ids)) if self.samples else 0

    @property
    def num_logits_rows(self) -> int:
        """Logits rows this chunk computes: those it samples, and, for a request scoring its prompt, one per
        prompt token it scores (the step cost model's ``num_samples``: each is a row of the LM head)."""
        request = self.request
        if request.sampling_params.prompt_logprobs is None:
            return self.num_samples
        start = request.num_computed_tokens
        return self.num_samples + len(request.prompt_positions_to_score(start, start + self.num_new_tokens))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Admitted with their blocks allocated; the engine starts pulling their prompt KV.
    remote_reads: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ForwardInput:
    """One flat varlen batch, already on the model's device."""

    token_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn: AttentionMetadata
    # int64 [num_samples + num_prompt_rows]: the sampled rows, then the prompt rows scored for logprobs.
    logits_indices: torch.Tensor
    sampling_requests: list[Request]  # one per sampled row
    # Verify groups (``pd.engine.spec.verify``): each sampled row's offset after its request's last token
    # (None when no request verifies drafts), and each group's first row with its drafts.
    sample_offsets: list[int] | None = None
    groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Requests asking for prompt logprobs, with how many rows of this step score their prompt (in order).
    prompt_rows: list[tuple[Request, int]] = field(default_factory=list)
    prompt_targets: torch.Tensor | None = None  # int64 [num_prompt_rows]: the token each prompt row scores
    # The new tokens of every sequence when all have as many (1: a decode step); None when they differ.
    query_len: int | None = None


@dataclass(frozen=True)
class ForwardOutput:
    """Sampled tokens, one per request whose ``samples`` flag was set, in schedule order.

    A row whose sampling failed has no token: ``errors`` maps its index to why.
    ``stop_rows`` are rows whose token completed their request's grammar: the
    request stops there whatever its other settings say (``ignore_eos``).
    """

    sampled_token_ids: list[int | None]
    logprobs: list[float] | None
    errors: dict[int, str] = field(default_factory=dict)
    # Per sampled row, when any request asked for alternatives (None for the rows that did not).
    top_logprobs: list[TopLogprobs | None] | None = None
    # Prompt scores computed this step, by request id, in prompt order.
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)
    stop_rows: frozenset[int] = frozenset()
    # The step's time where a runner models it rather than runs it (the simulator's); None: measured.
    modelled_seconds: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int
    kv_source: KVSource = KVSource.LOCAL
    queue_seconds: float = 0.0  # arrival to first admission on this engine
    # Prefill role: the encoded KVHandle of the pinned prompt blocks, on the finishing output.
    kv_handle: bytes | None = None
    error: str | None = None  # with FinishReason.ERROR: why this request failed
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # with new_logprobs, when asked for
    # On the output that carries the first sampled token, when asked for: every prompt token's score.
    prompt_logprobs: list[PromptLogprob] | None = None
    timings: EngineTimings | None = None  # on the output that carries this engine's first token
    # On the finishing output: the draft tokens this engine verified for the request, and those it accepted.
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
