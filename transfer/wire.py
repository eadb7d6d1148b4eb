"""Typed, versioned msgpack messages between processes, and the KV handle.

Every message that crosses a process is a ``WireMessage``: a frozen msgspec
struct, decoded from its type hints with one strictness everywhere. Every
field is type-checked (a bool is not an int, a string is not a number),
unknown and missing fields are refused with an error naming them, and
cross-field rules live in ``validate``. Ray may carry the bytes, but nothing
received is ever unpickled.

On the wire each message is one envelope:

    {"v": WIRE_VERSION, "kind": KIND, "body": packed struct, "digest": blake2b-128 of body}

The digest turns a flipped byte into a refusal: a ``KVHandle`` whose block
ids changed in transit would otherwise pull the wrong blocks and answer with
garbage.
"""

from __future__ import annotations

import array
import enum
import hashlib
import sys
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

WIRE_VERSION = 15
DIGEST_BYTES = 16

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]

M = TypeVar("M", bound="WireMessage")


class WireError(ValueError):
    """A message that cannot be trusted: truncated, garbled, wrong version or wrong shape."""


class WireMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every cross-process message; a subclass names its ``KIND``.

    Subclasses put rules that span fields in ``validate`` (raise ``ValueError``);
    they run on construction and on decode alike.
    """

    KIND: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Cross-field rules; raise ``ValueError`` naming the problem."""

    def encode(self) -> bytes:
        return seal(self.KIND, _ENCODER.encode(self))

    def replace(self: M, **changes: Any) -> M:
        """A copy with ``changes`` applied (and validated)."""
        return msgspec.structs.replace(self, **changes)

    @classmethod
    def decode(cls: type[M], data: Any) -> M:
        """The message in ``data``; ``WireError`` if it cannot be trusted."""
        kind, body = _open(data, (cls.KIND,))
        return _decode_body(cls, body)


def decode_one_of(data: Any, types: tuple[type[M], ...]) -> M:
    """``data`` as whichever of ``types`` its envelope names."""
    by_kind = {t.KIND: t for t in types}
    kind, body = _open(data, tuple(by_kind))
    return _decode_body(by_kind[kind], body)


class PoolMetadata(WireMessage, frozen=True, kw_only=True):
    """What every transport's ``local_metadata()`` says of its pool; each backend adds how to reach it."""

    name: NonEmptyStr  # the engine id, which names its transport endpoint
    block_bytes: PositiveInt
    num_blocks: PositiveInt
    # The equal slices a block divides into, outermost: its KV heads (pd.engine.kv_layout), so a
    # peer of another tensor-parallel split reads a range of them; 1 where a block moves whole only.
    num_heads: PositiveInt = 1


class TransportKind(str, enum.Enum):
    NIXL = "nixl"
    TORCH = "torch"


class LayoutFingerprint(WireMessage, frozen=True, kw_only=True):
    """What must match for KV bytes from one pool to mean the same in another."""

    KIND: ClassVar[str] = "layout_fingerprint"

    model: str
    dtype: str  # the pool's element type: the model's, or an FP8 format
    # An FP8 pool's per-layer k/v scales, as a digest (pd.model.kv_scales.digest); "" for other pools.
    # Bytes stored under other scales would decode to other values, so it must match too.
    kv_scales: str = ""
    num_layers: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt  # a pool row's values: a KV head's, or MLA's latent and rotary key
    kv_planes: PositiveInt = 2  # rows per head, layer and token: K and V, or MLA's one latent
    block_size: PositiveInt
    block_layout: str  # the order of a block's dimensions (pd.engine.kv_layout.BLOCK_LAYOUT)
    # The ranks the model's KV heads are split over (pd.model.tp); pools of different splits are
    # bridged head range by head range (pd.model.tp.kv_head_sources), so it need not match. Expert
    # parallelism is not here: the KV belongs to attention, so pools of any expert-parallel sizes
    # read each other's blocks as their attention splits say.
    tensor_parallel_size: PositiveInt = 1

    BRIDGED: ClassVar[tuple[str, ...]] = ("tensor_parallel_size",)

    def check_compatible(self, other: "LayoutFingerprint") -> None:
        """Raise ``WireError`` naming every field that differs (and cannot be bridged)."""
        diffs = [
            f"{name}: {getattr(other, name)!r} != {getattr(self, name)!r}"
            for name in self.__struct_fields__
            if name not in self.BRIDGED and getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise WireError("KV layout fingerprint mismatch (remote != local): " + "; ".join(diffs))


class KVHandle(WireMessage, frozen=True, kw_only=True):
    """Where a prefilled prompt's KV blocks live, and for how long.

    Sent by the prefill replica with the first sampled token; the decode
    replica pulls ``block_ids`` (blocks of ``block_size`` tokens, the last
    possibly partial, covering ``num_tokens`` prompt tokens) from the engine
    ``engine_id`` over ``transport``. ``peer_metadata`` is that transport's
    ``local_metadata()`` (the NIXL agent metadata, inline). The blocks stay
    pinned until the decode side's completion notification, an abort, or
    ``lease_expiry`` (Unix seconds), whichever comes first. ``prompt_digest``
    (``prompt_digest(token_ids)``) lets the decode side refuse a handle for
    another prompt of the same length, and ``adapter`` with ``adapter_digest``
    (the LoRA adapter the KV was computed under, its name and weights' digest;
    empty for the base model) one computed under other weights. A tensor-parallel prefill engine adds
    ``rank_metadata``: the transports of its ranks 1..N-1, each over its own
    pool (``fingerprint.tensor_parallel_size`` ranks in all).
    """

    KIND: ClassVar[str] = "kv_handle"

    request_id: str
    engine_id: str
    transport: TransportKind
    peer_metadata: bytes
    block_ids: tuple[NonNegativeInt, ...]
    num_tokens: PositiveInt
    block_size: PositiveInt
    fingerprint: LayoutFingerprint
    first_token_id: NonNegativeInt
    lease_expiry: float
    prompt_digest: bytes
    rank_metadata: tuple[bytes, ...] = ()
    adapter: str = ""
    adapter_digest: str = ""

    def validate(self) -> None:
        if self.block_size != self.fingerprint.block_size:
            raise ValueError("kv_handle.block_size disagrees with its fingerprint")
        if len(self.rank_metadata) != self.fingerprint.tensor_parallel_size - 1:
            raise ValueError(f"kv_handle has {len(self.rank_metadata)} ranks' metadata beyond rank 0, for "
                             f"tensor_parallel_size {self.fingerprint.tensor_parallel_size}")
        if len(self.block_ids) != -(-self.num_tokens // self.block_size):
            raise ValueError(f"kv_handle has {len(self.block_ids)} blocks for {self.num_tokens} tokens "
                             f"of block_size {self.block_size}")


def prompt_digest(token_ids) -> bytes:
    """A 128-bit digest of a prompt's token ids, as ``KVHandle.prompt_digest`` carries it."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=DIGEST_BYTES).digest()


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    kind: str
    body: bytes
    digest: bytes


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def seal(kind: str, body: bytes) -> bytes:
    """A packed ``body`` in the envelope of ``kind`` (``WireMessage.encode``; tests craft bad bodies with it)."""
    return _ENCODER.encode(_Envelope(WIRE_VERSION, kind, body, _digest(body)))


def _open(data: Any, kinds: tuple[str, ...]) -> tuple[str, bytes]:
    """``(kind, body)`` of an envelope whose kind is one of ``kinds``, its digest checked."""
    expected = " or ".join(kinds)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{expected} must be bytes, got {type(data).__name__}")
    try:
        envelope = _ENVELOPE.decode(data)
    except msgspec.DecodeError as exc:  # truncated, garbled, or not our envelope
        raise WireError(f"{expected} is not a valid message envelope: {exc}") from None
    if envelope.v != WIRE_VERSION:
        raise WireError(f"{expected} has wire version {envelope.v!r}; this build speaks {WIRE_VERSION}")
    if envelope.kind not in kinds:
        raise WireError(f"expected a {expected} message, got {envelope.kind!r}")
    if _digest(envelope.body) != envelope.digest:
        raise WireError(f"{envelope.kind} failed its digest check (corrupted in transit)")
    return envelope.kind, envelope.body


def _decode_body(cls: type[M], body: bytes) -> M:
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError included: names the field and the problem
        raise WireError(f"{cls.KIND}: {exc}") from None
