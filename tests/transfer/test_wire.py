"""``KVHandle`` and ``LayoutFingerprint``: versioned msgpack, decoded strictly from their type hints."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from tests.wire import body_of, sealed
from transfer import WIRE_VERSION, KVHandle, LayoutFingerprint, WireError
from transfer.wire import prompt_digest

FINGERPRINT = LayoutFingerprint(model="builtin:tiny-llama", dtype="float32", num_layers=4, num_kv_heads=2,
                                head_dim=16, block_size=16, block_layout="heads-outer")


def make_handle(**overrides) -> KVHandle:
    fields = dict(
        request_id="req-1", engine_id="prefill-0", transport="nixl",
        peer_metadata=b"\x00agent\xff", block_ids=(7, 8, 3), num_tokens=40, block_size=16,
        fingerprint=FINGERPRINT, first_token_id=42, lease_expiry=1_700_000_030.5,
        prompt_digest=prompt_digest(range(40)),
    )
    return KVHandle(**{**fields, **overrides})


def body(handle: KVHandle) -> dict:
    return body_of(handle.encode())


def resealed(body: dict) -> bytes:
    """A well-formed envelope (valid digest) around a hand-edited body."""
    return sealed("kv_handle", body)


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
    with pytest.raises(WireError, match="not a valid message envelope"):
        KVHandle.decode(data[:cut])


def test_garbled_handle_is_refused():
    data = bytearray(make_handle().encode())
    data[0] = 0xC1  # a byte msgpack never uses
    with pytest.raises(WireError, match="not a valid message envelope"):
        KVHandle.decode(bytes(data))
    with pytest.raises(WireError, match="not a valid message envelope"):
        KVHandle.decode(msgpack.packb([1, 2, 3]))
    with pytest.raises(WireError, match="must be bytes"):
        KVHandle.decode("not bytes")


def test_wrong_version_and_kind_are_refused():
    message = msgpack.unpackb(make_handle().encode(), raw=False)
    with pytest.raises(WireError, match=f"wire version {WIRE_VERSION + 1}"):
        KVHandle.decode(msgpack.packb({**message, "v": WIRE_VERSION + 1}))
    with pytest.raises(WireError, match="expected a kv_handle message, got 'nixl_peer'"):
        KVHandle.decode(msgpack.packb({**message, "kind": "nixl_peer"}))
    with pytest.raises(WireError, match=r"Expected `bytes`, got `object` - at `\$.body`"):
        KVHandle.decode(msgpack.packb({**message, "body": body(make_handle())}))
    with pytest.raises(WireError, match="unknown field `extra`"):
        KVHandle.decode(msgpack.packb({**message, "extra": 1}))


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("request_id", 17, r"Expected `str`, got `int` - at `\$.request_id`"),
        ("num_tokens", "40", r"Expected `int`, got `str` - at `\$.num_tokens`"),
        ("first_token_id", True, r"Expected `int`, got `bool` - at `\$.first_token_id`"),
        ("peer_metadata", "text", r"Expected `bytes`, got `str` - at `\$.peer_metadata`"),
        ("block_ids", [7, "8", 3], r"Expected `int`, got `str` - at `\$.block_ids\[1\]`"),
        ("block_ids", [7, -8, 3], r"Expected `int` >= 0 - at `\$.block_ids\[1\]`"),
        ("block_ids", [7, 8], "2 blocks for 40 tokens"),
        ("transport", "carrier-pigeon", r"Invalid enum value 'carrier-pigeon' - at `\$.transport`"),
        ("block_size", 8, "block_size disagrees with its fingerprint"),
        ("fingerprint", "fp", r"Expected `object`, got `str` - at `\$.fingerprint`"),
        ("prompt_digest", "abc", r"Expected `bytes`, got `str` - at `\$.prompt_digest`"),
        ("surprise", 1, "unknown field `surprise`"),
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
    with pytest.raises(WireError, match=r"missing required field `head_dim` - at `\$.fingerprint`"):
        KVHandle.decode(resealed(edited))


def test_fingerprint_mismatch_names_each_differing_field():
    FINGERPRINT.check_compatible(msgspec.structs.replace(FINGERPRINT))
    other = msgspec.structs.replace(FINGERPRINT, dtype="bfloat16", num_kv_heads=4)
    with pytest.raises(WireError) as refused:
        FINGERPRINT.check_compatible(other)
    assert "dtype: 'bfloat16' != 'float32'" in str(refused.value)
    assert "num_kv_heads: 4 != 2" in str(refused.value)
    assert "head_dim" not in str(refused.value)


def test_fingerprints_of_other_tensor_parallel_splits_are_bridged_but_other_layouts_are_not():
    FINGERPRINT.check_compatible(msgspec.structs.replace(FINGERPRINT, tensor_parallel_size=4))
    with pytest.raises(WireError, match="block_layout: 'heads-inner' != 'heads-outer'"):
        FINGERPRINT.check_compatible(msgspec.structs.replace(FINGERPRINT, block_layout="heads-inner",
                                                             tensor_parallel_size=2))
