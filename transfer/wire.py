"""Versioned msgpack wire messages between replicas.

Ray may carry these bytes, but they are always our own msgpack, validated
field by field on receipt; nothing received is ever unpickled.

Every message is one envelope: ``{"v": version, "kind": kind, "body": packed
body, "digest": blake2b-128 of the packed body}``. The digest turns a flipped
byte into a refusal: a ``KVHandle`` whose block ids changed in transit would
otherwise pull the wrong blocks and answer with garbage.
"""

from __future__ import annotations

import array
import hashlib
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import msgpack

WIRE_VERSION = 2
DIGEST_BYTES = 16
TRANSPORT_KINDS = ("nixl", "torch")


class WireError(ValueError):
    """A message that cannot be trusted: truncated, garbled, wrong version or wrong shape."""


@dataclass(frozen=True)
class LayoutFingerprint:
    """What must match for KV bytes from one pool to mean the same in another."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def check_compatible(self, other: "LayoutFingerprint") -> None:
        """Raise ``WireError`` naming every field that differs."""
        diffs = [
            f"{f.name}: {getattr(other, f.name)!r} != {getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise WireError("KV layout fingerprint mismatch (remote != local): " + "; ".join(diffs))


@dataclass(frozen=True)
class KVHandle:
    """Where a prefilled prompt's KV blocks live, and for how long.

    Sent by the prefill replica with the first sampled token; the decode
    replica pulls ``block_ids`` (blocks of ``block_size`` tokens, the last
    possibly partial, covering ``num_tokens`` prompt tokens) from the engine
    ``engine_id`` over ``transport``. ``peer_metadata`` is that transport's
    ``local_metadata()`` (the NIXL agent metadata, inline). The blocks stay
    pinned until the decode side's completion notification, an abort, or
    ``lease_expiry`` (Unix seconds), whichever comes first. ``prompt_digest``
    (``prompt_digest(token_ids)``) lets the decode side refuse a handle for
    another prompt of the same length.
    """

    request_id: str
    engine_id: str
    transport: str
    peer_address: str
    peer_metadata: bytes
    block_ids: tuple[int, ...]
    num_tokens: int
    block_size: int
    fingerprint: LayoutFingerprint
    first_token_id: int
    lease_expiry: float
    prompt_digest: bytes

    def encode(self) -> bytes:
        body = asdict(self)
        body["block_ids"] = list(self.block_ids)
        return encode_message("kv_handle", body)

    @classmethod
    def decode(cls, data: bytes) -> "KVHandle":
        body = _unpack(data, "kv_handle")
        fp = _field(body, "fingerprint", dict)
        fingerprint = LayoutFingerprint(
            model=_field(fp, "model", str),
            dtype=_field(fp, "dtype", str),
            num_layers=_field(fp, "num_layers", int),
            num_kv_heads=_field(fp, "num_kv_heads", int),
            head_dim=_field(fp, "head_dim", int),
            block_size=_field(fp, "block_size", int),
        )
        block_ids = _field(body, "block_ids", list)
        if not all(isinstance(b, int) and b >= 0 for b in block_ids):
            raise WireError("kv_handle.block_ids must be non-negative integers")
        handle = cls(
            request_id=_field(body, "request_id", str),
            engine_id=_field(body, "engine_id", str),
            transport=_field(body, "transport", str),
            peer_address=_field(body, "peer_address", str),
            peer_metadata=_field(body, "peer_metadata", bytes),
            block_ids=tuple(block_ids),
            num_tokens=_field(body, "num_tokens", int),
            block_size=_field(body, "block_size", int),
            fingerprint=fingerprint,
            first_token_id=_field(body, "first_token_id", int),
            lease_expiry=float(_field(body, "lease_expiry", (int, float))),
            prompt_digest=_field(body, "prompt_digest", bytes),
        )
        if handle.transport not in TRANSPORT_KINDS:
            raise WireError(f"kv_handle.transport {handle.transport!r} is not one of {TRANSPORT_KINDS}")
        if handle.block_size != fingerprint.block_size:
            raise WireError("kv_handle.block_size disagrees with its fingerprint")
        expected_blocks = -(-handle.num_tokens // handle.block_size) if handle.block_size > 0 else -1
        if handle.num_tokens < 1 or len(block_ids) != expected_blocks:
            raise WireError(
                f"kv_handle has {len(block_ids)} blocks for {handle.num_tokens} tokens of block_size {handle.block_size}"
            )
        return handle


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """A 128-bit digest of a prompt's token ids, as ``KVHandle.prompt_digest`` carries it."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=DIGEST_BYTES).digest()


def _digest(packed_body: bytes) -> bytes:
    return hashlib.blake2b(packed_body, digest_size=DIGEST_BYTES).digest()


def _unpack(data: Any, kind: str) -> dict:
    return _unpack_any(data, (kind,))[1]


def _unpack_any(data: Any, kinds: tuple[str, ...]) -> tuple[str, dict]:
    kind = " or ".join(kinds)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{kind} must be bytes, got {type(data).__name__}")
    try:
        message = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for truncated or garbled input
        raise WireError(f"{kind} is not valid msgpack (truncated or garbled): {exc}") from None
    if not isinstance(message, dict):
        raise WireError(f"{kind} must be a msgpack map")
    if message.get("v") != WIRE_VERSION:
        raise WireError(f"{kind} has wire version {message.get('v')!r}; this build speaks {WIRE_VERSION}")
    if message.get("kind") not in kinds:
        raise WireError(f"expected a {kind} message, got {message.get('kind')!r}")
    packed, digest = message.get("body"), message.get("digest")
    if not isinstance(packed, bytes) or not isinstance(digest, bytes):
        raise WireError(f"{kind} must carry a packed body and its digest")
    if _digest(packed) != digest:
        raise WireError(f"{kind} failed its digest check (corrupted in transit)")
    try:
        body = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except Exception as exc:  # a digest that matches garbage: sent that way
        raise WireError(f"{kind}.body is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise WireError(f"{kind}.body must be a map")
    return message["kind"], body


def _field(body: dict, name: str, kind) -> Any:
    if name not in body:
        raise WireError(f"message is missing the field {name!r}")
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"field {name!r} has type {type(value).__name__}")
    return value


def encode_message(kind: str, body: dict) -> bytes:
    """``body`` as a versioned msgpack message of ``kind`` (the envelope every wire message uses)."""
    packed = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"v": WIRE_VERSION, "kind": kind, "body": packed, "digest": _digest(packed)},
                         use_bin_type=True)


def decode_message(data: Any, kind: str) -> dict:
    """The body of a versioned msgpack message of ``kind``; ``WireError`` if it cannot be trusted."""
    return _unpack(data, kind)


def decode_any_message(data: Any, kinds: tuple[str, ...]) -> tuple[str, dict]:
    """``(kind, body)`` of a versioned msgpack message whose kind is one of ``kinds``."""
    return _unpack_any(data, kinds)


def require_field(body: dict, name: str, kind) -> Any:
    """``body[name]``, checked to be an instance of ``kind`` (bools are not ints)."""
    return _field(body, name, kind)
