"""Pool messages: round trips, and garbage refused with a clear error (never unpickled)."""

from __future__ import annotations

import msgpack
import pytest

from pd import SamplingParams
from pd.serve.messages import DecodeChunk, PoolControl, PoolRequest, PrefillResult
from router.requests import routing_fields
from transfer.wire import WireError, encode_message

REQUEST = PoolRequest(request_id="r1", token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=5, seed=7),
                      block_hashes=[b"12345678"], target_replica_id="abc", exclude_replica_ids=["x"],
                      kv_handle=b"handle", first_token_id=9)


@pytest.mark.parametrize("message", [
    REQUEST,
    PoolControl(request_id="r1", target_replica_id="abc", payload=b"\x00\x01"),
    PrefillResult(request_id="r1", replica_id="abc", first_token_id=4, first_logprob=-0.5, kv_handle=b"h",
                  num_cached_tokens=16, finish_reason="length"),
    DecodeChunk(request_id="r1", token_ids=[5, 6], logprobs=[], finish_reason=None, num_cached_tokens=0,
                prefill="remote"),
])
def test_round_trip(message):
    assert type(message).decode(message.encode()) == message


def test_routers_read_the_routing_fields():
    fields = routing_fields(REQUEST.encode())
    assert (fields.request_id, fields.num_tokens, fields.block_hashes) == ("r1", 3, [b"12345678"])
    assert fields.target_replica_id == "abc" and fields.exclude_replica_ids == ["x"]
    assert routing_fields(b"\x80garbage") is None and routing_fields("not bytes") is None


@pytest.mark.parametrize("data, match", [
    (b"", "not valid msgpack"),
    (REQUEST.encode()[:-3], "not valid msgpack"),
    (msgpack.packb({"v": 99, "kind": "pool_request", "body": b"", "digest": b""}), "wire version 99"),
    (encode_message("decode_chunk", {}), "expected a pool_request"),
    (encode_message("pool_request", {"request_id": "r"}), "missing the field"),
    (encode_message("pool_request", {
        "request_id": "r", "token_ids": ["a"], "block_hashes": [], "exclude_replica_ids": [], "sampling": {}}),
     "token_ids"),
    (encode_message("pool_request", {
        "request_id": "r", "token_ids": [1], "block_hashes": [], "exclude_replica_ids": [],
        "sampling": {"max_tokens": 0}}), "max_tokens"),
    (REQUEST.encode().replace(b"r1", b"r2"), "digest check"),
])
def test_garbage_is_refused_with_a_clear_error(data, match):
    with pytest.raises(WireError, match=match):
        PoolRequest.decode(data)
