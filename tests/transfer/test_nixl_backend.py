"""NIXL backend details that need no second process: metadata, deadlines, empty reads, close."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

pytest.importorskip("transfer.nixl_api")

from tests.wire import body_of, sealed  # noqa: E402
from transfer import TransferError, TransferState, WireError, create_transport  # noqa: E402
from transfer.nixl_backend import NixlPeer, NixlTransport  # noqa: E402

BLOCK_SHAPE = (2, 2, 4, 2, 16)


@pytest.fixture
def transports():
    made = []

    def make(name: str, *, num_blocks: int = 8, timeout_s: float = 5.0) -> NixlTransport:
        transport = create_transport("nixl", name, timeout_s=timeout_s)
        made.append(transport)
        transport.register(torch.arange(num_blocks * 512, dtype=torch.float32).view(num_blocks, *BLOCK_SHAPE))
        return transport

    yield make
    for transport in made:
        transport.close()


def test_metadata_round_trips_and_names_the_pool(transports):
    transport = transports("meta-a", num_blocks=8)
    peer = NixlPeer.decode(transport.local_metadata())
    assert (peer.name, peer.num_blocks, peer.block_bytes, peer.mem_type.value) == ("meta-a", 8, 2048, "DRAM")
    assert peer.agent_metadata and peer.base_address > 0


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda body: body.pop("agent_metadata"), "missing required field `agent_metadata`"),
        (lambda body: body.update(num_blocks="8"), r"Expected `int`, got `str` - at `\$.num_blocks`"),
        (lambda body: body.update(mem_type="HBM"), r"Invalid enum value 'HBM' - at `\$.mem_type`"),
        (lambda body: body.update(block_bytes=0), r"Expected `int` >= 1 - at `\$.block_bytes`"),
        (lambda body: body.update(name=""), r"Expected `str` of length >= 1 - at `\$.name`"),
    ],
)
def test_bad_peer_metadata_is_refused(transports, mutate, message):
    transport = transports("meta-b")
    body = body_of(transport.local_metadata())
    mutate(body)
    with pytest.raises(WireError, match=message):
        transport.add_peer(sealed("nixl_peer", body))
    with pytest.raises(WireError, match="not a valid message envelope"):
        transport.add_peer(transport.local_metadata()[:-7])


def test_add_peer_is_idempotent_and_refuses_its_own_name(transports):
    reader, owner = transports("idem-reader"), transports("idem-owner")
    assert reader.add_peer(owner.local_metadata()) == "idem-owner"
    assert reader.add_peer(owner.local_metadata()) == "idem-owner"
    with pytest.raises(TransferError, match="own name"):
        reader.add_peer(reader.local_metadata())


def test_a_read_pending_past_its_deadline_fails(transports, monkeypatch):
    reader, owner = transports("slow-reader", timeout_s=0.1), transports("slow-owner")
    reader.add_peer(owner.local_metadata())
    monkeypatch.setattr(reader._agent.nixl, "check_xfer_state", lambda xfer: "PROC")
    handle = reader.read_blocks("slow-owner", [1, 2], [3, 4], notify="slow")
    assert handle.wait(2.0) is TransferState.FAILED
    assert "still pending after 0.1s" in handle.error
    assert not handle.quiesced()  # still in flight as far as NIXL says: its blocks stay held
    monkeypatch.undo()
    deadline = time.monotonic() + 5.0
    while not handle.quiesced():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_an_empty_read_is_done_and_still_notifies_the_owner(transports):
    reader, owner = transports("empty-reader"), transports("empty-owner")
    reader.add_peer(owner.local_metadata())
    assert reader.read_blocks("empty-owner", [], [], notify="all-cached").poll() is TransferState.DONE
    seen = []
    for _ in range(200):
        seen += owner.poll_notifications()
        if seen:
            break
        time.sleep(0.005)
    assert seen == ["all-cached"]


def test_close_is_idempotent_and_final(transports):
    reader, owner = transports("close-reader"), transports("close-owner")
    reader.add_peer(owner.local_metadata())
    assert reader.read_blocks("close-owner", [0], [0], notify="x").wait(5.0) is TransferState.DONE
    reader.close()
    reader.close()
    with pytest.raises(TransferError, match="closed"):
        reader.read_blocks("close-owner", [0], [0], notify="y")
    with pytest.raises(TransferError, match="closed"):
        reader.local_metadata()
    assert reader.poll_notifications() == []


def _cpu_seconds_of(thread_ids: set[str]) -> float:
    ticks = 0
    for tid in thread_ids:
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads' CPU time from /proc")
def test_an_idle_transport_leaves_the_cores_alone(transports):
    """NIXL's UCX progress thread polled without ever sleeping, a whole core per agent (idle or not)."""
    before = set(os.listdir("/proc/self/task"))
    reader, owner = transports("idle-reader"), transports("idle-owner")
    reader.add_peer(owner.local_metadata())
    assert reader.read_blocks("idle-owner", [0, 1], [2, 3], notify="x").wait(5.0) is TransferState.DONE
    started = set(os.listdir("/proc/self/task")) - before
    assert started, "NIXL started no thread: this test no longer measures anything"
    cpu_before, wall_before = _cpu_seconds_of(started), time.monotonic()
    threading.Event().wait(1.0)  # the window measured: nothing to synchronise with
    busy = (_cpu_seconds_of(started) - cpu_before) / (time.monotonic() - wall_before)
    assert busy < 0.1, f"two idle NIXL agents' threads used {busy:.2f} of a core"


def test_a_finished_read_reports_the_bytes_nixl_moved(transports):
    reader, owner = transports("bytes-reader"), transports("bytes-owner")
    reader.add_peer(owner.local_metadata())
    read = reader.read_blocks("bytes-owner", [0, 1, 5], [2, 3, 7], notify="x")  # two runs: descriptors of 2 and 1
    assert read.wait(5.0) is TransferState.DONE
    assert read.moved_bytes == 3 * 512 * 4  # three blocks of 512 fp32, as NIXL's telemetry counts them
