"""The torch.distributed backend: a two-rank gloo (CPU) or NCCL (CUDA) group per pair.

Who hosts what: the *prefill* transport hosts a ``TCPStore`` server, created
with the transport; its host and port travel in ``local_metadata()``. The
store listens on all interfaces (a known property of ``TCPStore``, whatever
``host`` says), so run this backend only on a trusted network. For each
decode engine that reads from it there is one pairwise group, prefill rank 0
and decode rank 1, built on demand over ``PrefixStore(group, store)``. There
is no global world.

What triggers the send: gloo and NCCL are two-sided, so the prefill side
must act. The decode transport is given ``control(peer, message) -> reply``,
which delivers ``message`` to the prefill transport's ``handle_control`` in
the prefill process (in serving, a Ray Serve call pinned to that prefill
replica). ``handle_control`` validates the message, queues the work on the
pair's worker thread and replies at once; the worker does the sending:

    decode: read_blocks -> link worker thread         prefill: handle_control -> pair worker thread
      control(torch_connect) ----------------------->  reply ok; worker joins the group as rank 0
      join the group as rank 1  <=== rendezvous over the TCPStore ===>
      control(torch_send) -------------------------->  reply ok (ids checked); worker sends each run
      recv each run into its local blocks <========== send pool[start : start + num_blocks]
      handle DONE                                      request_id queued for poll_notifications()

Control messages (versioned msgpack, ``transfer.wire`` envelopes):
    torch_connect {decode, group, device}
    torch_send    {decode, group, request_id, block_ids, run_lengths, first_tag}
    torch_reply   {ok, error}
``run_lengths`` splits ``block_ids`` into the runs the decode side merged
pairwise (``block_runs``); run ``i`` travels as one message with tag
``first_tag + i``.

Failure: every step is bounded by ``timeout_s`` (the store, the group
rendezvous, each receive). A failed read aborts the pair's group, so no late
bytes can land in blocks the decode engine has given up on; the next read
builds a new group. ``control`` must itself time out (a Serve call with a
timeout, say).
"""

from __future__ import annotations

import collections
import datetime
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from transfer.base import KVTransport, TransferError, TransferHandle, TransferState, check_read, pool_geometry
from transfer.wire import WireError, decode_any_message, decode_message, encode_message, require_field

logger = logging.getLogger(__name__)

PEER_KIND = "torch_peer"
CONNECT_KIND = "torch_connect"
SEND_KIND = "torch_send"
REPLY_KIND = "torch_reply"
ROLES = ("prefill", "decode")
PREFILL_RANK, DECODE_RANK = 0, 1
TAG_LIMIT = 1 << 24

Control = Callable[[str, bytes], bytes]


@dataclass(frozen=True)
class TorchPeer:
    """What ``local_metadata()`` carries: where the pool is and, for prefill, its store."""

    name: str
    role: str
    host: str
    port: int
    block_bytes: int
    num_blocks: int
    device: str

    def encode(self) -> bytes:
        return encode_message(PEER_KIND, dict(self.__dict__))

    @classmethod
    def decode(cls, data: bytes) -> "TorchPeer":
        body = decode_message(data, PEER_KIND)
        peer = cls(**{name: require_field(body, name, kind) for name, kind in (
            ("name", str), ("role", str), ("host", str), ("port", int),
            ("block_bytes", int), ("num_blocks", int), ("device", str),
        )})
        if peer.role not in ROLES or not peer.name or peer.block_bytes < 1 or peer.num_blocks < 1:
            raise WireError(f"torch_peer {peer.name!r} has role {peer.role!r} or a non-positive size")
        return peer


class TorchTransport(KVTransport):
    """KV transport over pairwise torch.distributed groups; see the module docstring.

    ``role="prefill"`` hosts the store (on ``port``, 0 for any free one) and
    answers ``handle_control``; ``role="decode"`` reads and needs ``control``
    to reach its peers. ``host`` is this engine's address as peers reach it:
    the store is advertised there and the gloo device binds to it, so on a
    cluster it is the node's IP. ``timeout_s`` bounds each read.
    """

    kind = "torch"

    def __init__(self, engine_id: str, *, role: str, host: str = "127.0.0.1", port: int = 0,
                 control: Control | None = None, timeout_s: float = 10.0):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if role == "decode" and control is None:
            raise ValueError("a decode-side TorchTransport needs control(peer, message) to reach prefill peers")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.engine_id = engine_id
        self.role = role
        self.host = host
        self.timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._control = control
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None
        self._closed = False
        self._store: TCPStore | None = None
        if role == "prefill":
            self._store = TCPStore(host, port, is_master=True, timeout=self._timeout, wait_for_workers=False)
        self._pairs: dict[str, _Pair] = {}  # prefill side, by decode engine
        self._notifications: collections.deque[str] = collections.deque()
        self._peers: dict[str, TorchPeer] = {}  # decode side, by prefill engine
        self._links: dict[str, _Link] = {}

    # -- setup ---------------------------------------------------------------

    def register(self, kv_cache: torch.Tensor) -> None:
        self._check_open()
        if self._pool is not None:
            raise TransferError(f"{self.engine_id}: the KV pool is already registered")
        _, self._block_bytes = pool_geometry(kv_cache)
        self._pool = kv_cache

    def local_metadata(self) -> bytes:
        pool = self._require_pool()
        port = self._store.port if self._store is not None else 0
        return TorchPeer(self.engine_id, self.role, self.host, port, self._block_bytes, pool.shape[0],
                         pool.device.type).encode()

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        peer = TorchPeer.decode(metadata)
        if self.role == "decode" and peer.role != "prefill":
            raise TransferError(f"a decode engine reads from prefill peers; {peer.name!r} is {peer.role}")
        with self._lock:
            known = self._peers.get(peer.name)
            if known == peer:
                return peer.name
            if known is not None:  # restarted under the same name: the old group is dead
                logger.info("%s: peer %s changed its metadata; replacing it", self.engine_id, peer.name)
                link = self._links.pop(peer.name, None)
                if link is not None:
                    link.stop(f"peer {peer.name!r} restarted")
            self._peers[peer.name] = peer
        return peer.name

    # -- decode side ---------------------------------------------------------

    def read_blocks(
        self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], notify: str
    ) -> TransferHandle:
        self._check_open()
        pool = self._require_pool()
        if self.role != "decode":
            raise TransferError("only a decode-side TorchTransport reads blocks")
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"{self.engine_id}: unknown peer {peer!r}; add_peer its metadata first")
        if remote.block_bytes != self._block_bytes or remote.device != pool.device.type:
            raise TransferError(f"peer {peer!r} has {remote.block_bytes}-byte {remote.device} blocks, "
                                f"ours are {self._block_bytes}-byte {pool.device.type}")
        runs = check_read(remote_block_ids, local_block_ids, peer=peer, remote_num_blocks=remote.num_blocks,
                          engine=self.engine_id, local_num_blocks=pool.shape[0])
        handle = _TorchReadHandle(peer, len(runs), time.monotonic() + self.timeout_s)
        with self._lock:
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = _Link(self, remote)
        link.submit(handle, runs, notify)
        return handle

    # -- prefill side --------------------------------------------------------

    def handle_control(self, message: bytes) -> bytes:
        """Answer a decode transport's control message; returns a ``torch_reply``.

        Never raises for a bad message: the reply carries the error. Work is
        queued on the pair's worker thread, so this returns at once.
        """
        try:
            if self._closed or self.role != "prefill" or self._pool is None:
                raise TransferError(f"{self.engine_id} does not serve reads (closed, decode role, or no pool)")
            kind, body = decode_any_message(message, (CONNECT_KIND, SEND_KIND))
            if kind == CONNECT_KIND:
                self._on_connect(body)
            else:
                self._on_send(body)
        except (TransferError, WireError) as exc:
            return encode_message(REPLY_KIND, {"ok": False, "error": str(exc)})
        return encode_message(REPLY_KIND, {"ok": True, "error": ""})

    def _on_connect(self, body: dict) -> None:
        decode = require_field(body, "decode", str)
        group = require_field(body, "group", str)
        device = require_field(body, "device", str)
        if device != self._pool.device.type:
            raise TransferError(f"{decode!r} has a {device} pool, {self.engine_id!r} a {self._pool.device.type} one")
        pair = _Pair(self, decode, group)
        with self._lock:
            old = self._pairs.get(decode)
            self._pairs[decode] = pair
        if old is not None:
            old.stop()
        pair.start()

    def _on_send(self, body: dict) -> None:
        decode = require_field(body, "decode", str)
        group = require_field(body, "group", str)
        request_id = require_field(body, "request_id", str)
        block_ids = require_field(body, "block_ids", list)
        run_lengths = require_field(body, "run_lengths", list)
        first_tag = require_field(body, "first_tag", int)
        runs = _runs_from_lengths(block_ids, run_lengths, self._pool.shape[0])
        if not runs:  # nothing to move: the reader only releases the lease
            self._notifications.append(request_id)
            return
        with self._lock:
            pair = self._pairs.get(decode)
        if pair is None or pair.group != group:
            raise TransferError(f"{self.engine_id} has no group {group!r} with {decode!r}; reconnect")
        pair.submit(request_id, runs, first_tag)

    def poll_notifications(self) -> list[str]:
        notifications = []
        while self._notifications:
            notifications.append(self._notifications.popleft())
        return notifications

    # -- teardown ------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, pairs = list(self._links.values()), list(self._pairs.values())
            self._links.clear()
            self._pairs.clear()
        for link in links:
            link.stop(f"{self.engine_id} closed")
        for pair in pairs:
            pair.stop()
        for worker in links + pairs:  # groups die in close(), not in interpreter teardown
            worker.thread.join(self.timeout_s)
        self._store = None
        self._pool = None

    def _forget_pair(self, pair: "_Pair") -> None:
        with self._lock:
            if self._pairs.get(pair.decode) is pair:
                del self._pairs[pair.decode]

    def _require_pool(self) -> torch.Tensor:
        self._check_open()
        if self._pool is None:
            raise TransferError(f"{self.engine_id}: register the KV pool first")
        return self._pool

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.engine_id}: the transport is closed")

    def _new_group(self, store, group: str, rank: int):
        return new_pair_group(PrefixStore(group, store), rank, self._pool.device, self.host, self._timeout)


class _TorchReadHandle(TransferHandle):
    """A read run by the link's worker thread.

    Phases: queued -> receiving -> DONE/FAILED. The deadline fails a read at
    once unless it is receiving; a receive is bounded by the same deadline
    in the worker, which aborts the group before reporting.
    """

    def __init__(self, peer: str, num_runs: int, deadline: float):
        self.peer = peer
        self.num_descriptors = num_runs
        self.deadline = deadline
        self._lock = threading.Lock()
        self._state = TransferState.PENDING
        self._receiving = False
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        return self._error

    def poll(self) -> TransferState:
        with self._lock:
            if self._state is TransferState.PENDING and not self._receiving and time.monotonic() >= self.deadline:
                self._state, self._error = TransferState.FAILED, f"read from {self.peer!r} timed out before receiving"
            return self._state

    def release(self) -> None:
        self.fail("released while pending")

    def fail(self, error: str) -> None:
        with self._lock:
            if self._state is TransferState.PENDING:
                self._state, self._error = TransferState.FAILED, error
                self._receiving = False

    def start_receiving(self) -> bool:
        """Enter the receiving phase; False if the read already ended (deadline, release)."""
        with self._lock:
            if self._state is not TransferState.PENDING or time.monotonic() >= self.deadline:
                return False
            self._receiving = True
            return True

    def is_pending(self) -> bool:
        return self.poll() is TransferState.PENDING

    def done(self) -> None:
        with self._lock:
            self._state, self._receiving = TransferState.DONE, False


class _Link:
    """Decode side: one prefill peer's group and the thread that runs reads from it, in order."""

    def __init__(self, transport: TorchTransport, peer: TorchPeer):
        self.transport = transport
        self.peer = peer
        self.group_name: str | None = None
        self.group = None
        self.store = None
        self.next_tag = 0
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"kv-link-{peer.name}", daemon=True)
        self.thread.start()

    def submit(self, handle: _TorchReadHandle, runs: list[tuple[int, int, int]], notify: str) -> None:
        self.queue.put((handle, runs, notify))

    def stop(self, reason: str) -> None:
        while True:  # reads still queued will never run
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].fail(reason)
        self.queue.put(None)
        self._drop_group()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            handle, runs, notify = item
            try:
                self._read(handle, runs, notify)
            except Exception as exc:
                self._drop_group()
                handle.fail(f"read from {self.peer.name!r} failed: {type(exc).__name__}: {exc}")
        self._drop_group()

    def _read(self, handle: _TorchReadHandle, runs: list[tuple[int, int, int]], notify: str) -> None:
        if not handle.is_pending():
            return
        if not runs:  # nothing to move (all prefix hits); the owner still frees its lease
            try:
                self._call(SEND_KIND, self._send_body(notify, runs, first_tag=0))
            except Exception as exc:  # the lease expires on its own; the decode side has all it needs
                logger.warning("%s: notifying %s of %s failed: %s", self.transport.engine_id, self.peer.name,
                               notify, exc)
            handle.done()
            return
        if self.group is None:
            self._connect()
            if not handle.is_pending():
                return
        first_tag = self.next_tag
        self.next_tag = (self.next_tag + len(runs)) % TAG_LIMIT
        self._call(SEND_KIND, self._send_body(notify, runs, first_tag))
        if not handle.start_receiving():  # gave up while the peer may be sending: that group is spoiled
            self._drop_group()
            return
        pool = self.transport._pool
        works = [self.group.recv([pool[local : local + n]], PREFILL_RANK, (first_tag + i) % TAG_LIMIT)
                 for i, (_, local, n) in enumerate(runs)]
        for work in works:
            remaining = handle.deadline - time.monotonic()
            if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                raise TransferError(f"receive still pending after {self.transport.timeout_s}s")
        handle.done()

    def _send_body(self, request_id: str, runs: list[tuple[int, int, int]], first_tag: int) -> dict:
        return {
            "decode": self.transport.engine_id, "group": self.group_name or "", "request_id": request_id,
            "block_ids": [b for remote, _, n in runs for b in range(remote, remote + n)],
            "run_lengths": [n for _, _, n in runs], "first_tag": first_tag,
        }

    def _connect(self) -> None:
        self.group_name = f"kv/{self.peer.name}/{self.transport.engine_id}/{uuid.uuid4().hex}"
        self.store = TCPStore(self.peer.host, self.peer.port, is_master=False, timeout=self.transport._timeout)
        self._call(CONNECT_KIND, {
            "decode": self.transport.engine_id, "group": self.group_name,
            "device": self.transport._pool.device.type,
        })
        self.group = self.transport._new_group(self.store, self.group_name, DECODE_RANK)

    def _call(self, kind: str, body: dict) -> None:
        reply = decode_message(self.transport._control(self.peer.name, encode_message(kind, body)), REPLY_KIND)
        if not require_field(reply, "ok", bool):
            raise TransferError(f"{self.peer.name!r} refused {kind}: {require_field(reply, 'error', str)}")

    def _drop_group(self) -> None:
        group, self.group, self.group_name, self.store = self.group, None, None, None
        abort_group(group)


class _Pair:
    """Prefill side: one decode engine's group and the thread that sends to it, in order."""

    def __init__(self, transport: TorchTransport, decode: str, group: str):
        self.transport = transport
        self.decode = decode
        self.group = group
        self.process_group = None
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"kv-pair-{decode}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, request_id: str, runs: list[tuple[int, int]], first_tag: int) -> None:
        self.queue.put((request_id, runs, first_tag))

    def stop(self) -> None:
        self.queue.put(None)
        abort_group(self.process_group)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.process_group = None

    def _serve(self) -> None:
        transport = self.transport
        try:
            self.process_group = transport._new_group(transport._store, self.group, PREFILL_RANK)
        except Exception as exc:
            logger.warning("%s: group %s with %s never formed: %s", transport.engine_id, self.group, self.decode, exc)
            transport._forget_pair(self)
            return
        while (item := self.queue.get()) is not None:
            request_id, runs, first_tag = item
            try:
                pool = transport._pool
                works = [self.process_group.send([pool[start : start + n]], DECODE_RANK, (first_tag + i) % TAG_LIMIT)
                         for i, (start, n) in enumerate(runs)]
                for work in works:
                    work.wait()
            except Exception as exc:  # the reader is gone or gave up; it will reconnect
                logger.warning("%s: sending %s to %s failed: %s", transport.engine_id, request_id, self.decode, exc)
                abort_group(self.process_group)
                transport._forget_pair(self)
                return
            transport._notifications.append(request_id)


def new_pair_group(store, rank: int, device: torch.device, host: str, timeout: datetime.timedelta):
    """A two-rank group on ``store``: NCCL for CUDA pools, gloo (bound to ``host``) otherwise."""
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, options)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(store, rank, 2, options)


def abort_group(group) -> None:
    """Abort a group's pending operations so no late bytes land; idempotent."""
    if group is None:
        return
    try:
        group.abort()
    except Exception as exc:  # some builds lack abort; dropping the last reference closes it too
        logger.debug("aborting a process group: %s", exc)


def _runs_from_lengths(block_ids: list, run_lengths: list, num_blocks: int) -> list[tuple[int, int]]:
    """``(start, num_blocks)`` runs of ids inside the pool; each run must be consecutive ids."""
    bad = [b for b in block_ids if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks]
    if bad:
        raise TransferError(f"block ids {bad[:8]} are outside this pool of {num_blocks} blocks")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in run_lengths) \
            or sum(run_lengths) != len(block_ids):
        raise WireError(f"run_lengths {run_lengths[:8]} do not split {len(block_ids)} block ids")
    runs, start = [], 0
    for n in run_lengths:
        ids = block_ids[start : start + n]
        if ids != list(range(ids[0], ids[0] + n)):
            raise WireError(f"block ids {ids[:8]} are not one consecutive run")
        runs.append((ids[0], n))
        start += n
    return runs
