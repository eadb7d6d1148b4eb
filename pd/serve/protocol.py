"""The messages between the ingress and the engine pools, and between replicas.

Every call to a pool carries two encoded arguments: ``router.protocol.RouteHints``
(what request routers read) and one of the payloads below. Each is a
``transfer.wire.WireMessage``: typed, decoded from its type hints with one
strictness, carrying enums rather than strings. Ray only carries the bytes.
"""

from __future__ import annotations

import re
from typing import ClassVar

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.engine.request import FinishReason, KVSource
from pd.engine.timings import EngineTimings
from pd.sampling_params import SamplingParams
from transfer.wire import NonEmptyStr, NonNegativeInt, WireMessage

TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


class RequestTimings(WireMessage, frozen=True, kw_only=True):
    """What an engine measured of one request, up to its first token out of it (``EngineTimings``).

    Seconds: ``queue_s`` from arrival to admission, ``first_token_s`` from
    admission to the first token, of which ``pull_s`` pulling KV. The
    ingress places them in the request's timeline (``pd.serve.timeline``).
    """

    queue_s: float
    first_token_s: float
    pull_s: float = 0.0
    num_pulled_bytes: NonNegativeInt = 0
    num_pulled_blocks: NonNegativeInt = 0
    num_pull_descriptors: NonNegativeInt = 0
    pull_error: str = ""  # why the KV pull failed; the prompt was recomputed
    num_prompt_chunks: NonNegativeInt = 0  # steps that computed part of the prompt here
    num_preemptions: NonNegativeInt = 0

    def validate(self) -> None:
        for name in ("queue_s", "first_token_s", "pull_s"):
            if not getattr(self, name) >= 0.0:  # NaN fails too
                raise ValueError(f"{name} must be a non-negative number of seconds, got {getattr(self, name)}")

    @classmethod
    def of(cls, timings: EngineTimings | None) -> "RequestTimings | None":
        if timings is None:
            return None
        return cls(queue_s=timings.queue_s, first_token_s=timings.first_token_s, pull_s=timings.pull_s,
                   num_pulled_bytes=timings.num_pulled_bytes, num_pulled_blocks=timings.num_pulled_blocks,
                   num_pull_descriptors=timings.num_pull_descriptors, pull_error=timings.pull_error,
                   num_prompt_chunks=timings.num_prompt_chunks,
                   num_preemptions=timings.num_preemptions)


class LoraRef(WireMessage, frozen=True, kw_only=True):
    """The LoRA adapter a request runs under: its name, the peft directory it loads from, and the digest of the
    weights the ingress checked there (``pd.lora.adapter``). A replica holding other weights under the name
    loads these; one that finds other weights at the path refuses the request. Sent alone, it asks a
    replica to load (or unload) that adapter."""

    KIND: ClassVar[str] = "lora_ref"

    name: NonEmptyStr
    path: NonEmptyStr
    digest: NonEmptyStr


class PoolRequest(WireMessage, frozen=True, kw_only=True):
    """One request to a prefill or decode replica.

    ``kv_handle`` (decode only) is an encoded ``KVHandle`` of a remote
    prefill, and ``first_token_id`` the token that prefill sampled. A
    ``first_token_id`` without a handle means the prompt's KV cannot be had:
    the decode replica recomputes it and continues after that token.
    ``traceparent`` (W3C trace context) is the ingress's span of this call
    when tracing is on: the replica's own spans go under it. ``lora``: the
    adapter it runs under (None: the base model); ``priority``: its
    scheduling priority on every replica it reaches.
    """

    KIND: ClassVar[str] = "pool_request"

    request_id: str
    token_ids: tuple[NonNegativeInt, ...]
    sampling: SamplingParams
    kv_handle: bytes | None = None
    first_token_id: NonNegativeInt | None = None
    # The last ``num_generated`` of ``token_ids`` are output already streamed (a stream that moved
    # replicas): a structured-output grammar replays them before continuing.
    num_generated: NonNegativeInt = 0
    traceparent: str = ""
    lora: LoraRef | None = None
    priority: int = 0  # vLLM's: lower is more urgent (``pd.engine.priority``)

    def validate(self) -> None:
        if not -2**31 < self.priority < 2**31:
            raise ValueError(f"priority must be within ±2**31, got {self.priority}")
        if self.traceparent and not TRACEPARENT.fullmatch(self.traceparent):
            raise ValueError(f"traceparent must be a W3C trace context (00-<32 hex>-<16 hex>-<2 hex>), "
                             f"got {self.traceparent[:80]!r}")


class PoolControl(WireMessage, frozen=True, kw_only=True):
    """A replica-to-replica message: a lease release for ``request_id``, or a transport's control bytes."""

    KIND: ClassVar[str] = "pool_control"

    request_id: str = ""
    payload: bytes = b""


class ReplicaReplacement(WireMessage, frozen=True, kw_only=True):
    """The ingress asks a replica to be replaced: it fails its health checks from then on, naming ``reason``."""

    KIND: ClassVar[str] = "replica_replacement"

    reason: NonEmptyStr


class PrefillResult(WireMessage, frozen=True, kw_only=True):
    """A prefill replica's answer: the first token and the handle to the pinned KV.

    ``first_top_logprobs`` and ``prompt_logprobs`` are there when the request
    asked for them: the prompt is scored where it runs.
    """

    KIND: ClassVar[str] = "prefill_result"

    request_id: str
    replica_id: str
    first_token_id: NonNegativeInt
    first_logprob: float | None
    kv_handle: bytes
    num_cached_tokens: NonNegativeInt
    first_top_logprobs: TopLogprobs | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    timings: RequestTimings | None = None
    # Seconds the replica's handler took, from the call reaching it to its answer (0: not measured). The rest
    # of the call as the ingress saw it is Ray's: routing, delivery and the reply.
    handler_s: float = 0.0

    def validate(self) -> None:
        if not self.handler_s >= 0.0:  # NaN fails too
            raise ValueError(f"handler_s must be a non-negative number of seconds, got {self.handler_s}")


class RequestFailed(WireMessage, frozen=True, kw_only=True):
    """A prefill replica's answer when the request itself failed (not the replica): never retried."""

    KIND: ClassVar[str] = "request_failed"

    request_id: str
    error: str
    # The engine refused the request as it stands (too long for its KV pool, say): the client's error, a 400.
    invalid: bool = False


class DecodeChunk(WireMessage, frozen=True, kw_only=True):
    """New tokens from a decode replica; the last chunk has a finish reason (``ERROR`` with ``error``).

    ``top_logprobs`` has one entry per token when the request asked for
    alternatives; ``prompt_logprobs`` comes once, with the first sampled token,
    when the request asked for prompt scores.
    """

    KIND: ClassVar[str] = "decode_chunk"

    request_id: str
    token_ids: tuple[NonNegativeInt, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None
    num_cached_tokens: NonNegativeInt
    kv_source: KVSource
    error: str = ""
    invalid: bool = False  # with ``error``: as ``RequestFailed.invalid``
    top_logprobs: tuple[TopLogprobs, ...] = ()
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    timings: RequestTimings | None = None  # with the first chunk that has a token
    # With the finish reason: the draft tokens the replica verified for the request, and those it accepted.
    num_spec_draft_tokens: NonNegativeInt = 0
    num_spec_accepted_tokens: NonNegativeInt = 0
