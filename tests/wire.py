"""Crafting wire messages by hand, for tests that send bad input."""

from __future__ import annotations

import msgspec

from transfer.wire import seal


def body_of(data: bytes) -> dict:
    """The body of an encoded message, as a plain dict to edit."""
    envelope = msgspec.msgpack.decode(data)
    return msgspec.msgpack.decode(envelope["body"])


def sealed(kind: str, body) -> bytes:
    """``body`` (any msgpack value) in a well-formed envelope of ``kind``, with a valid digest."""
    return seal(kind, msgspec.msgpack.encode(body))
