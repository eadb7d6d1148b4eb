"""The messages between the ingress and the engine pools, and between replicas.

Every call to a pool carries two encoded arguments: ``router.protocol.RouteHints``
(what request routers read) and one of the payloads below. Each is a
``transfer.wire.WireMessage``: typed, decoded from its type hints with one
strictness, carrying enums rather than strings. Ray only carries the bytes.
"""

from __future__ import annotations

from typing import ClassVar

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.engine.request import FinishReason, KVSource
from pd.sampling_params import SamplingParams
from transfer.wire import NonNegativeInt, WireMessage


class PoolRequest(WireMessage, frozen=True, kw_only=True):
    """One request to a prefill or decode replica.

    ``kv_handle`` (decode only) is an encoded ``KVHandle`` of a remote
    prefill, and ``first_token_id`` the token that prefill sampled. A
    ``first_token_id`` without a handle means the prompt's KV cannot be had:
    the decode replica recomputes it and continues after that token.
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


class PoolControl(WireMessage, frozen=True, kw_only=True):
    """A replica-to-replica message: a lease release for ``request_id``, or a transport's control bytes."""

    KIND: ClassVar[str] = "pool_control"

    request_id: str = ""
    payload: bytes = b""


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


class RequestFailed(WireMessage, frozen=True, kw_only=True):
    """A prefill replica's answer when the request itself failed (not the replica): never retried."""

    KIND: ClassVar[str] = "request_failed"

    request_id: str
    error: str


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
    top_logprobs: tuple[TopLogprobs, ...] = ()
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
