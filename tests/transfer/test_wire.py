"""``KVHandle`` and ``LayoutFingerprint``: versioned msgpack, validated field by field."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from transfer import WIRE_VERSION, KVHandle, LayoutFingerprint, WireError

FINGERPRINT = LayoutFingerprint(model="builtin:tiny-llama", dtype="float32", num_layers=4, num_kv_heads=2,
                                head_dim=16, block_size=16)


def make_handle(**overrides) -> KVHandle:
    fields = dict(
        request_id="req-1", engine_id="prefill-0", transport="nixl", peer_address="10.0.0.1",
        peer_metadata=b"\x00agent\xff", block_ids=(7, 8, 3), num_tokens=40, block_size=16,
        fingerprint=FINGERPRINT, first_token_id=42, lease_expiry=1_700_000_030.5,
    )
    return KVHandle(**{**fields, **overrides})


def envelope(handle: KVHandle) -> dict:
    return msgpack.unpackb(handle.encode(), raw=False)


def test_handle_round_trips():
    handle = make_handle()
    assert KVHandle.decode(handle.encode()) == handle
    assert KVHandle.decode(bytearray(handle.encode())) == handle


def test_integer_lease_expiry_decodes_as_float():
    message = envelope(make_handle())
    message["body"]["lease_expiry"] = 1_700_000_030
    assert KVHandle.decode(msgpack.packb(message)).lease_expiry == 1_700_000_030.0


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
    message = envelope(make_handle())
    with pytest.raises(WireError, match=f"wire version {WIRE_VERSION + 1}"):
        KVHandle.decode(msgpack.packb({**message, "v": WIRE_VERSION + 1}))
    with pytest.raises(WireError, match="expected a kv_handle message, got 'nixl_peer'"):
        KVHandle.decode(msgpack.packb({**message, "kind": "nixl_peer"}))


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
    ],
)
def test_wrong_field_types_and_values_are_refused(field, value, error):
    message = envelope(make_handle())
    message["body"][field] = value
    with pytest.raises(WireError, match=error):
        KVHandle.decode(msgpack.packb(message))


def test_missing_field_is_named():
    message = envelope(make_handle())
    del message["body"]["fingerprint"]["head_dim"]
    with pytest.raises(WireError, match="missing the field 'head_dim'"):
        KVHandle.decode(msgpack.packb(message))


def test_fingerprint_mismatch_names_each_differing_field():
    FINGERPRINT.check_compatible(dataclasses.replace(FINGERPRINT))
    other = dataclasses.replace(FINGERPRINT, dtype="bfloat16", num_kv_heads=4)
    with pytest.raises(WireError) as refused:
        FINGERPRINT.check_compatible(other)
    assert "dtype: 'bfloat16' != 'float32'" in str(refused.value)
    assert "num_kv_heads: 4 != 2" in str(refused.value)
    assert "head_dim" not in str(refused.value)
