"""Pool messages and routing hints: round trips, and bad input refused naming the field (never unpickled)."""

from __future__ import annotations

import msgpack
import pytest

from pd import SamplingParams
from pd.engine.request import FinishReason, KVSource
from pd.serve.protocol import DecodeChunk, LoraRef, PoolControl, PoolRequest, PrefillResult
from router.protocol import CacheEvent, RouteHints, RoutingStats, read_route_hints
from tests.wire import body_of, sealed
from transfer.wire import WireError

REQUEST = PoolRequest(request_id="r1", token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=5, seed=7),
                      kv_handle=b"handle", first_token_id=9, priority=-3,
                      lora=LoraRef(name="sql", path="/adapters/sql", digest="ab" * 16))
CHUNK = DecodeChunk(request_id="r1", token_ids=(5, 6), logprobs=(), finish_reason=None, num_cached_tokens=0,
                    kv_source=KVSource.REMOTE)
HINTS = RouteHints(request_id="r1", num_prompt_tokens=3, block_hashes=(b"12345678",), target_replica_id="abc",
                   exclude_replica_ids=("x",))
STATS = RoutingStats(num_running=2, kv_usage=0.5, cache_events_from=3,
                     cache_events=(CacheEvent(seq=3, block_hash=b"h" * 8, stored=True),))


@pytest.mark.parametrize("message", [
    REQUEST,
    PoolControl(request_id="r1", payload=b"\x00\x01"),
    PrefillResult(request_id="r1", replica_id="abc", first_token_id=4, first_logprob=-0.5, kv_handle=b"h",
                  num_cached_tokens=16),
    CHUNK,
    CHUNK.replace(finish_reason=FinishReason.LENGTH, logprobs=(-0.1, -0.2)),
    HINTS,
    STATS,
])
def test_round_trip(message):
    assert type(message).decode(message.encode()) == message


def test_routers_read_the_hints_and_nothing_else():
    assert read_route_hints(HINTS.encode()) == HINTS
    assert read_route_hints(REQUEST.encode()) is None  # a payload is not hints
    assert read_route_hints(b"\x80garbage") is None and read_route_hints("not bytes") is None


def _request(**fields) -> bytes:
    body = {"request_id": "r", "token_ids": [1], "sampling": {}, **fields}
    return sealed("pool_request", body)


@pytest.mark.parametrize("data, match", [
    (b"", "not a valid message envelope"),
    (REQUEST.encode()[:-3], "not a valid message envelope"),
    (msgpack.packb({"v": 99, "kind": "pool_request", "body": b"", "digest": b""}), "wire version 99"),
    (sealed("decode_chunk", {}), "expected a pool_request"),
    (sealed("pool_request", {"request_id": "r"}), "missing required field `token_ids`"),
    (_request(token_ids=["a"]), r"Expected `int`, got `str` - at `\$.token_ids\[0\]`"),
    (_request(token_ids=[True]), r"Expected `int`, got `bool` - at `\$.token_ids\[0\]`"),
    (_request(token_ids=[-1]), r"Expected `int` >= 0 - at `\$.token_ids\[0\]`"),
    (_request(sampling={"max_tokens": 0}), "max_tokens must be an integer >= 1"),
    (_request(sampling={"temprature": 0.5}), "unknown field `temprature`"),
    (_request(target_replica_id="abc"), "unknown field `target_replica_id`"),
    (REQUEST.encode().replace(b"r1", b"r2"), "digest check"),
    (_request(priority=2**31), r"priority must be within"),
    (_request(priority="high"), r"Expected `int`, got `str` - at `\$.priority`"),
    (_request(lora={"name": "", "path": "/a", "digest": "d"}), r"at `\$.lora.name`"),
])
def test_bad_requests_are_refused_naming_the_problem(data, match):
    with pytest.raises(WireError, match=match):
        PoolRequest.decode(data)


@pytest.mark.parametrize("handler_s", [-0.5, float("nan")])
def test_a_prefill_result_with_no_sense_of_its_handlers_time_is_refused(handler_s):
    body = {"request_id": "r1", "replica_id": "abc", "first_token_id": 4, "first_logprob": None,
            "kv_handle": b"h", "num_cached_tokens": 0, "handler_s": handler_s}
    with pytest.raises(WireError, match="handler_s must be a non-negative number of seconds"):
        PrefillResult.decode(sealed("prefill_result", body))


@pytest.mark.parametrize("field, value, match", [
    ("finish_reason", "done", r"Invalid enum value 'done' - at `\$.finish_reason`"),
    ("kv_source", "elsewhere", r"Invalid enum value 'elsewhere' - at `\$.kv_source`"),
    ("token_ids", [5, "6"], r"Expected `int`, got `str` - at `\$.token_ids\[1\]`"),
    ("logprobs", ["x"], r"Expected `float`, got `str` - at `\$.logprobs\[0\]`"),
])
def test_chunks_are_as_strict_as_requests(field, value, match):
    """A bad finish reason or token id is refused, not turned into None or passed on."""
    body = {**body_of(CHUNK.encode()), field: value}
    with pytest.raises(WireError, match=match):
        DecodeChunk.decode(sealed("decode_chunk", body))


@pytest.mark.parametrize("field, value, match", [
    ("kv_usage", 1.5, r"kv_usage must be in \[0, 1\]"),
    ("num_running", True, r"Expected `int`, got `bool` - at `\$.num_running`"),
    ("cache_events", [[1, b"h", 1]], r"Expected `bool`, got `int` - at `\$.cache_events\[0\]\[2\]`"),
    ("cache_events", [[1, b"h"]], r"Expected `array` of at least length 3, got 2 - at `\$.cache_events\[0\]`"),
    ("cache_events", [[1, b"h", True, 0, 0]], r"Expected `array` of at most length 4, got 5 - at `\$.cache_events\[0\]`"),
    ("cache_events", [[1, b"h", True, 4]], r"Invalid enum value 4 - at `\$.cache_events\[0\]\[3\]`"),
])
def test_routing_stats_are_checked_too(field, value, match):
    body = {**body_of(STATS.encode()), field: value}
    with pytest.raises(WireError, match=match):
        RoutingStats.decode(sealed("routing_stats", body))
