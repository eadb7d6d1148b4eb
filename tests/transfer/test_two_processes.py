"""Both backends between real processes: a prefill peer owns the blocks, a decode peer reads them."""

from __future__ import annotations

import time

import pytest

from tests.transfer.peers import NUM_BLOCKS, Peer, PeerError, block_pattern, stop_all

pytestmark = pytest.mark.integration  # a peer process on each side of a transport

BACKENDS = ["nixl", "torch"]
PREFILL_SEED = 1
TIMEOUT_S = 3.0


def connect(decode: Peer, prefill: Peer) -> str:
    name = decode.call("add_peer", prefill.metadata)
    if prefill.control_address is not None:
        decode.call("set_control", name, prefill.control_address)
    return name


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request):
    kind = request.param
    peers = []
    try:
        peers.append(Peer(kind, "prefill-0", role="prefill", seed=PREFILL_SEED, timeout_s=TIMEOUT_S))
        peers.append(Peer(kind, "decode-0", role="decode", seed=None, timeout_s=TIMEOUT_S))
        prefill, decode = peers
        assert connect(decode, prefill) == "prefill-0"
        yield kind, prefill, decode
    finally:
        stop_all(peers)


def assert_holds(decode: Peer, local_ids, remote_ids, seed: int) -> None:
    got = decode.call("blocks", list(local_ids))
    for local, remote, data in zip(local_ids, remote_ids, got):
        assert data == block_pattern(seed, remote), f"local block {local} does not hold remote block {remote}"


@pytest.mark.parametrize(
    "remote_ids, local_ids",
    [
        ([3], [60]),
        ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]),  # one run
        ([40, 41, 42, 7, 9, 10, 63], [0, 1, 2, 30, 31, 33, 34]),  # runs split on either side
        ([17, 5, 33, 2, 50, 11, 48, 29], [44, 3, 19, 56, 6, 27, 38, 12]),  # shuffled
    ],
    ids=["one-block", "one-run", "gapped-runs", "shuffled"],
)
def test_read_copies_blocks_byte_exact(pair, remote_ids, local_ids):
    _, _, decode = pair
    decode.call("zero")
    [(state, error, _)] = decode.call("read", [("prefill-0", remote_ids, local_ids, "exact")], TIMEOUT_S)
    assert (state, error) == ("done", None)
    assert_holds(decode, local_ids, remote_ids, PREFILL_SEED)
    untouched = [b for b in range(NUM_BLOCKS) if b not in local_ids][:4]
    assert decode.call("blocks", untouched) == [bytes(len(block_pattern(0, 0)))] * len(untouched)


def test_concurrent_reads_each_notify_their_request(pair):
    _, prefill, decode = pair
    decode.call("zero")
    specs = [("prefill-0", [4 * i, 4 * i + 1, 63 - i], [i, 20 + i, 40 + i], f"req-{i}") for i in range(6)]
    results = decode.call("read", specs, TIMEOUT_S)
    assert [(state, error) for state, error, _ in results] == [("done", None)] * 6
    for _, remote_ids, local_ids, _ in specs:
        assert_holds(decode, local_ids, remote_ids, PREFILL_SEED)
    assert sorted(prefill.call("notifications", "req-", 6, TIMEOUT_S)) == [f"req-{i}" for i in range(6)]


@pytest.mark.parametrize(
    "remote_ids, local_ids, reason",
    [
        ([1, NUM_BLOCKS], [0, 1], "outside peer 'prefill-0'"),
        ([1, 2], [0, NUM_BLOCKS + 5], "outside decode-0"),
        ([-1], [0], "outside peer 'prefill-0'"),
        ([1, 2], [3, 3], "repeat a block"),
        ([1, 2], [3], "2 remote blocks but 1 local"),
    ],
    ids=["remote-past-end", "local-past-end", "negative", "local-repeats", "length-mismatch"],
)
def test_bad_block_ids_are_refused_before_any_bytes_move(pair, remote_ids, local_ids, reason):
    _, prefill, decode = pair
    decode.call("zero")
    with pytest.raises(PeerError, match=reason):
        decode.call("read", [("prefill-0", remote_ids, local_ids, "bad")], TIMEOUT_S)
    assert decode.call("blocks", [0, 1, 3]) == [bytes(len(block_pattern(0, 0)))] * 3
    assert prefill.call("notifications", "bad", 1, 0.2) == []


def test_restarted_peer_is_readded_and_a_killed_peer_fails_in_bounded_time(pair):
    kind, _, decode = pair
    peers = []
    try:
        first = Peer(kind, "prefill-r", role="prefill", seed=2, timeout_s=TIMEOUT_S)
        peers.append(first)
        assert connect(decode, first) == "prefill-r"
        [(state, _, _)] = decode.call("read", [("prefill-r", [5, 6], [0, 1], "before")], TIMEOUT_S)
        assert state == "done"
        assert_holds(decode, [0, 1], [5, 6], seed=2)

        first.kill()  # ... and it comes back under the same name with other contents
        second = Peer(kind, "prefill-r", role="prefill", seed=3, timeout_s=TIMEOUT_S)
        peers.append(second)
        assert connect(decode, second) == "prefill-r"
        [(state, error, _)] = decode.call("read", [("prefill-r", [5, 6, 9], [0, 1, 2], "after")], TIMEOUT_S)
        assert (state, error) == ("done", None)
        assert_holds(decode, [0, 1, 2], [5, 6, 9], seed=3)
        assert second.call("notifications", "", 1, TIMEOUT_S) == ["after"]

        if kind == "torch":
            second.call("die_on_send")  # it exits on the next send request, with the group formed
        else:
            second.kill()
        started = time.monotonic()
        [(state, error, _)] = decode.call("read", [("prefill-r", [1, 2], [7, 8], "dead")], 2 * TIMEOUT_S)
        assert state == "failed" and error
        assert time.monotonic() - started < TIMEOUT_S + 2.0
        second.process.join(5)
        assert not second.process.is_alive()
    finally:
        stop_all(peers)



def test_a_killed_reader_leaves_the_owner_serving(pair):
    kind, prefill, decode = pair
    peers = []
    try:
        doomed = Peer(kind, "decode-k", role="decode", seed=None, timeout_s=TIMEOUT_S)
        peers.append(doomed)
        connect(doomed, prefill)
        [(state, _, _)] = doomed.call("read", [("prefill-0", [1, 2], [1, 2], "kr-doomed")], TIMEOUT_S)
        assert state == "done"
        doomed.kill()

        [(state, error, _)] = decode.call("read", [("prefill-0", [3, 9], [4, 5], "kr-survivor")], TIMEOUT_S)
        assert (state, error) == ("done", None)
        assert_holds(decode, [4, 5], [3, 9], PREFILL_SEED)

        reborn = Peer(kind, "decode-k", role="decode", seed=None, timeout_s=TIMEOUT_S)
        peers.append(reborn)
        connect(reborn, prefill)
        [(state, error, _)] = reborn.call("read", [("prefill-0", [7, 8, 11], [0, 1, 2], "kr-reborn")], TIMEOUT_S)
        assert (state, error) == ("done", None)
        assert_holds(reborn, [0, 1, 2], [7, 8, 11], PREFILL_SEED)
        assert sorted(prefill.call("notifications", "kr-", 3, TIMEOUT_S)) == ["kr-doomed", "kr-reborn", "kr-survivor"]
    finally:
        stop_all(peers)
