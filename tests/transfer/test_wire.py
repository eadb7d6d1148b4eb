"""``KVHandle`` and ``LayoutFingerprint``: versioned msgpack, validated field by field."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from transfer import WIRE_VERSION, KVHandle, LayoutFingerprint, WireError
from transfer.wire import decode_message, encode_message, prompt_digest

FINGERPRINT = LayoutFingerprint(model="builtin:tiny-llama", dtype="float32", num_layers=4, num_kv_heads=2,
                                head_dim=16, block_size=16)


def make_handle(**overrides) -> KVHandle:
    fields = dict(
        request_id="req-1", engine_id="prefill-0", transport="nixl", peer_address="10.0.0.1",
        peer_metadata=b"\x00agent\xff", block_ids=(7, 8, 3), num_tokens=40, block_size=16,
        fingerprint=FINGERPRINT, first_token_id=42, lease_expiry=1_700_000_030.5,
        prompt_digest=prompt_digest(range(40)),
    )
    return KVHandle(**{**fields, **overrides})


def body(handle: KVHandle) -> dict:
    return decode_message(handle.encode(), "kv_handle")


def resealed(body: dict) -> bytes:
    """A well-formed envelope (valid digest) around a hand-edited body."""
    return encode_message("kv_handle", body)


def test_handle_round_trips():
    handle = make_handle()
    assert KVHandle.decode(handle.encode()) == handle
    assert KVHandle.decode(bytearray(handle.encode())) == handle


def test_integer_lease_expiry_decodes_as_float():
    edited = body(make_handle())
    edited["lease_expiry"] = 1_700_000_030
    assert KVHandle.decode(resealed(edited)).lease_expiry == 1_700_000_030.0


def test_any_flipped_byte_is_refused():
    """A handle changed in transit never decodes: it could name the wrong blocks."""
    data = make_handle().encode()
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        with pytest.raises(WireError):
            KVHandle.decode(bytes(flipped))
    block_ids_moved = data.replace(bytes([7, 8, 3]), bytes([7, 9, 3]))
    assert block_ids_moved != data
    with pytest.raises(WireError, match="digest check"):
        KVHandle.decode(block_ids_moved)


def test_prompt_digest_tells_prompts_apart():
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3))
    assert len({prompt_digest([1, 2, 3]), prompt_digest([1, 2, 4]), prompt_digest([3, 2, 1]),
                prompt_digest([1, 2]), prompt_digest([2**40, 2, 3])}) == 5


@pytest.mark.parametrize("cut", [1, 10, 60, -1])
def test_truncated_handle_is_refused(cut):
    data = make_handle().encode()
    with pytest.raises(WireError, match="truncated or garbled"):
        KVHandle.decode(data[:cut])


def test_garbled_handle_is_refused():
    data = bytearray(make_handle().encode())
    data[0] = 0xC1  # a byte msgpack never uses
    with pytest.raises(WireError, match="truncated or garbled"):
        KVHandle.decode(bytes(data))
    with pytest.raises(WireError, match="must be a msgpack map"):
        KVHandle.decode(msgpack.packb([1, 2, 3]))
    with pytest.raises(WireError, match="must be bytes"):
        KVHandle.decode("not bytes")


def test_wrong_version_and_kind_are_refused():
    message = msgpack.unpackb(make_handle().encode(), raw=False)
    with pytest.raises(WireError, match=f"wire version {WIRE_VERSION + 1}"):
        KVHandle.decode(msgpack.packb({**message, "v": WIRE_VERSION + 1}))
    with pytest.raises(WireError, match="expected a kv_handle message, got 'nixl_peer'"):
        KVHandle.decode(msgpack.packb({**message, "kind": "nixl_peer"}))
    with pytest.raises(WireError, match="packed body and its digest"):
        KVHandle.decode(msgpack.packb({**message, "body": body(make_handle())}))


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("request_id", 17, "'request_id' has type int"),
        ("num_tokens", "40", "'num_tokens' has type str"),
        ("first_token_id", True, "'first_token_id' has type bool"),
        ("peer_metadata", "text", "'peer_metadata' has type str"),
        ("block_ids", [7, "8", 3], "block_ids must be non-negative integers"),
        ("block_ids", [7, -8, 3], "block_ids must be non-negative integers"),
        ("block_ids", [7, 8], "2 blocks for 40 tokens"),
        ("transport", "carrier-pigeon", "'carrier-pigeon' is not one of"),
        ("block_size", 8, "block_size disagrees with its fingerprint"),
        ("fingerprint", "fp", "'fingerprint' has type str"),
        ("prompt_digest", "abc", "'prompt_digest' has type str"),
    ],
)
def test_wrong_field_types_and_values_are_refused(field, value, error):
    edited = body(make_handle())
    edited[field] = value
    with pytest.raises(WireError, match=error):
        KVHandle.decode(resealed(edited))


def test_missing_field_is_named():
    edited = body(make_handle())
    del edited["fingerprint"]["head_dim"]
    with pytest.raises(WireError, match="missing the field 'head_dim'"):
        KVHandle.decode(resealed(edited))


def test_fingerprint_mismatch_names_each_differing_field():
    FINGERPRINT.check_compatible(dataclasses.replace(FINGERPRINT))
    other = dataclasses.replace(FINGERPRINT, dtype="bfloat16", num_kv_heads=4)
    with pytest.raises(WireError) as refused:
        FINGERPRINT.check_compatible(other)
    assert "dtype: 'bfloat16' != 'float32'" in str(refused.value)
    assert "num_kv_heads: 4 != 2" in str(refused.value)
    assert "head_dim" not in str(refused.value)
