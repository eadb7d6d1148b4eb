"""Versioned msgpack messages between the ingress and the engine pools.

Ray carries these as bytes; each side decodes and validates them field by
field. Request routers read the routing fields of ``PoolRequest`` from a
call's first argument.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pd.sampling_params import SamplingParams
from transfer.wire import WireError, decode_message, encode_message, require_field

PREFILL_LOCAL = "local"
PREFILL_REMOTE = "remote"
PREFILL_RECOMPUTE = "recompute"  # remote prefill's KV could not be pulled; computed on decode


def _sampling_to_wire(params: SamplingParams) -> dict:
    body = asdict(params)
    body["stop_token_ids"] = list(params.stop_token_ids) if params.stop_token_ids is not None else None
    return body


def _sampling_from_wire(body: Any) -> SamplingParams:
    if not isinstance(body, dict):
        raise WireError("pool_request.sampling must be a map")
    try:
        return SamplingParams(**body)
    except (TypeError, ValueError) as exc:
        raise WireError(f"pool_request.sampling is invalid: {exc}") from None


@dataclass(frozen=True)
class PoolRequest:
    """One request to a prefill or decode replica.

    ``target_replica_id`` pins the call to one replica and
    ``exclude_replica_ids`` keeps it off others; request routers honour both
    before their own policy. ``kv_handle`` (decode only) is an encoded
    ``KVHandle`` of a remote prefill.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    block_hashes: list[bytes] = field(default_factory=list)
    target_replica_id: str | None = None
    exclude_replica_ids: list[str] = field(default_factory=list)
    kv_handle: bytes | None = None
    first_token_id: int | None = None  # with kv_handle: the token the prefill replica sampled

    def encode(self) -> bytes:
        body = asdict(self)
        body["sampling"] = _sampling_to_wire(self.sampling)
        return encode_message("pool_request", body)

    @classmethod
    def decode(cls, data: bytes) -> "PoolRequest":
        body = decode_message(data, "pool_request")
        token_ids = require_field(body, "token_ids", list)
        hashes = require_field(body, "block_hashes", list)
        excluded = require_field(body, "exclude_replica_ids", list)
        if not all(isinstance(t, int) for t in token_ids):
            raise WireError("pool_request.token_ids must be integers")
        if not all(isinstance(h, bytes) for h in hashes):
            raise WireError("pool_request.block_hashes must be bytes")
        target = body.get("target_replica_id")
        handle = body.get("kv_handle")
        first = body.get("first_token_id")
        if target is not None and not isinstance(target, str):
            raise WireError("pool_request.target_replica_id must be a string")
        if handle is not None and not isinstance(handle, bytes):
            raise WireError("pool_request.kv_handle must be bytes")
        if first is not None and not isinstance(first, int):
            raise WireError("pool_request.first_token_id must be an integer")
        return cls(
            request_id=require_field(body, "request_id", str),
            token_ids=token_ids,
            sampling=_sampling_from_wire(body.get("sampling")),
            block_hashes=hashes,
            target_replica_id=target,
            exclude_replica_ids=[str(r) for r in excluded],
            kv_handle=handle,
            first_token_id=first,
        )


@dataclass(frozen=True)
class PoolControl:
    """A replica-to-replica message pinned to ``target_replica_id``.

    Carries a transport's own control bytes (the torch backend's connect/send
    requests) or a lease release for ``request_id``.
    """

    request_id: str
    target_replica_id: str
    payload: bytes = b""

    def encode(self) -> bytes:
        return encode_message("pool_control", asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> "PoolControl":
        body = decode_message(data, "pool_control")
        return cls(
            request_id=require_field(body, "request_id", str),
            target_replica_id=require_field(body, "target_replica_id", str),
            payload=require_field(body, "payload", bytes),
        )


@dataclass(frozen=True)
class PrefillResult:
    """A prefill replica's answer: the first token and the handle to the pinned KV."""

    request_id: str
    replica_id: str
    first_token_id: int
    first_logprob: float | None
    kv_handle: bytes
    num_cached_tokens: int
    finish_reason: str | None

    def encode(self) -> bytes:
        return encode_message("prefill_result", asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> "PrefillResult":
        body = decode_message(data, "prefill_result")
        logprob = body.get("first_logprob")
        reason = body.get("finish_reason")
        return cls(
            request_id=require_field(body, "request_id", str),
            replica_id=require_field(body, "replica_id", str),
            first_token_id=require_field(body, "first_token_id", int),
            first_logprob=float(logprob) if isinstance(logprob, (int, float)) else None,
            kv_handle=require_field(body, "kv_handle", bytes),
            num_cached_tokens=require_field(body, "num_cached_tokens", int),
            finish_reason=reason if isinstance(reason, str) else None,
        )


@dataclass(frozen=True)
class DecodeChunk:
    """New tokens from a decode replica; the last chunk has a finish reason."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    num_cached_tokens: int
    prefill: str  # PREFILL_LOCAL, PREFILL_REMOTE or PREFILL_RECOMPUTE

    def encode(self) -> bytes:
        return encode_message("decode_chunk", asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> "DecodeChunk":
        body = decode_message(data, "decode_chunk")
        reason = body.get("finish_reason")
        return cls(
            request_id=require_field(body, "request_id", str),
            token_ids=require_field(body, "token_ids", list),
            logprobs=[float(x) for x in require_field(body, "logprobs", list)],
            finish_reason=reason if isinstance(reason, str) else None,
            num_cached_tokens=require_field(body, "num_cached_tokens", int),
            prefill=require_field(body, "prefill", str),
        )
