"""torch.distributed backend details that need no second process: control messages, deadlines, close."""

from __future__ import annotations

import re
import time

import msgpack
import pytest
import torch

from tests.wire import body_of, sealed
from transfer import TransferError, TransferState, WireError, create_transport
from transfer.torch import TorchPeer, TorchTransport
from transfer.wire import WIRE_VERSION

BLOCK_SHAPE = (2, 2, 4, 2, 16)


def never_called(peer: str, message: bytes) -> bytes:
    raise AssertionError("no control message expected")


@pytest.fixture
def transports():
    made = []

    def make(name: str, role: str, *, control=None, timeout_s: float = 5.0) -> TorchTransport:
        transport = create_transport("torch", name, role=role, control=control, timeout_s=timeout_s)
        made.append(transport)
        transport.register(torch.zeros(8, *BLOCK_SHAPE))
        return transport

    yield make
    for transport in made:
        transport.close()


def reply(transport: TorchTransport, kind: str, body: dict) -> dict:
    return body_of(transport.handle_control(sealed(kind, body)))


def send_body(**overrides) -> dict:
    body = {"decode": "d", "group": "g", "request_id": "r", "block_ids": [1, 2], "run_lengths": [2], "first_tag": 0}
    return {**body, **overrides}


def test_constructor_checks_role_and_control():
    with pytest.raises(ValueError, match="role"):
        TorchTransport("x", role="both")
    with pytest.raises(ValueError, match="control"):
        TorchTransport("x", role="decode")


def test_prefill_metadata_names_its_store(transports):
    prefill = transports("meta-prefill", "prefill")
    peer = TorchPeer.decode(prefill.local_metadata())
    assert (peer.name, peer.role, peer.host, peer.num_blocks, peer.block_bytes) == (
        "meta-prefill", "prefill", "127.0.0.1", 8, 2048)
    assert peer.port > 0


@pytest.mark.parametrize(
    "message, error",
    [
        (b"\xc1garbage", "not a valid message envelope"),
        (msgpack.packb({"v": WIRE_VERSION + 1, "kind": "torch_send", "body": b"", "digest": b""}), "wire version"),
        (sealed("torch_reply", {"ok": True}), "expected a torch_connect or torch_send message"),
        (sealed("torch_send", send_body(block_ids=[1, 99], run_lengths=[1, 1])), r"block ids \[99\]"),
        (sealed("torch_send", send_body(run_lengths=[3])), "do not split"),
        (sealed("torch_send", send_body(block_ids=[1, 3])), "not one consecutive run"),
        (sealed("torch_send", send_body(request_id=7)), r"Expected `str`, got `int` - at `\$.request_id`"),
        (sealed("torch_send", send_body()), "no group 'g' with 'd'; reconnect"),
        (sealed("torch_connect", {"decode": "d", "group": "g", "device": "cuda"}), "cuda pool"),
    ],
    ids=["garbled", "version", "wrong-kind", "bad-ids", "bad-runs", "not-a-run", "wrong-type", "no-group",
         "device-mismatch"],
)
def test_handle_control_refuses_bad_messages_with_a_reply(transports, message, error):
    prefill = transports("strict-prefill", "prefill")
    body = body_of(prefill.handle_control(message))
    assert body["ok"] is False
    assert re.search(error, body["error"]), body["error"]
    assert prefill.poll_notifications() == []


def test_an_empty_send_only_notifies(transports):
    prefill = transports("empty-prefill", "prefill")
    assert reply(prefill, "torch_send", send_body(block_ids=[], run_lengths=[], request_id="cached"))["ok"]
    assert prefill.poll_notifications() == ["cached"]


def test_decode_side_refuses_control_and_prefill_side_refuses_reads(transports):
    prefill = transports("role-prefill", "prefill")
    decode = transports("role-decode", "decode", control=never_called)
    assert reply(decode, "torch_send", send_body())["error"].startswith("role-decode does not serve reads")
    with pytest.raises(TransferError, match="decode-side"):
        prefill.read_blocks("role-decode", [0], [0], notify="x")
    with pytest.raises(TransferError, match="reads from prefill peers"):
        decode.add_peer(decode.local_metadata())


REPLY_AFTER_S = 2.0  # the slow peer's reply, ten times the read's deadline


def test_a_read_stuck_before_receiving_fails_at_its_deadline(transports):
    prefill = transports("slow-prefill", "prefill")

    def slow_control(peer: str, message: bytes) -> bytes:
        time.sleep(REPLY_AFTER_S)
        return sealed("torch_reply", {"ok": False, "error": "too late"})

    decode = transports("slow-decode", "decode", control=slow_control, timeout_s=0.2)
    decode.add_peer(prefill.local_metadata())
    started = time.monotonic()
    handle = decode.read_blocks("slow-prefill", [1], [2], notify="slow")
    assert handle.wait(3.0) is TransferState.FAILED
    # Failed at its deadline, well before the reply: the margin is most of the reply's delay, so that a busy
    # host's scheduling does not decide it.
    assert time.monotonic() - started < REPLY_AFTER_S * 0.75
    assert "timed out before receiving" in handle.error


def test_close_is_idempotent_and_final(transports):
    prefill = transports("close-prefill", "prefill")
    decode = transports("close-decode", "decode", control=never_called)
    decode.add_peer(prefill.local_metadata())
    for transport in (prefill, decode):
        transport.close()
        transport.close()
        with pytest.raises(TransferError, match="closed"):
            transport.local_metadata()
    with pytest.raises(TransferError, match="closed"):
        decode.read_blocks("close-prefill", [0], [0], notify="x")
    assert not reply(prefill, "torch_send", send_body(block_ids=[], run_lengths=[]))["ok"]
    with pytest.raises(WireError):
        TorchPeer.decode(b"\x92\x01")
