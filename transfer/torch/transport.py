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
pair's thread and replies at once; the thread does the sending:

    decode: read_blocks -> Link thread               prefill: handle_control -> Pair thread
      control(torch_connect) ----------------------->  reply ok; joins the group as rank 0
      join the group as rank 1  <=== rendezvous over the TCPStore ===>
      control(torch_send) -------------------------->  reply ok (ids checked); sends each run
      recv each run into its local blocks <========== send pool[start : start + num_blocks]
      read DONE                                        request_id queued for poll_notifications()

Messages are in ``transfer.torch.messages``. Every step is bounded by
``timeout_s`` (the store, the group rendezvous, each receive); ``control``
must itself time out (a Serve call with a timeout, say). A failed read drops
its pair's group; the next read builds a new one.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time

from torch.distributed import PrefixStore, TCPStore

from transfer.base import KVTransport, Run, TransferError, TransferHandle
from transfer.torch.group import new_pair_group
from transfer.torch.messages import Role, TorchConnect, TorchPeer, TorchReply, TorchSend
from transfer.torch.reader import Control, Link, NewGroup, TorchRead
from transfer.torch.sender import Pair
from transfer.wire import TransportKind, WireError, decode_one_of

logger = logging.getLogger(__name__)


class TorchTransport(KVTransport[TorchPeer]):
    """KV transport over pairwise torch.distributed groups; see the module docstring.

    ``role="prefill"`` hosts the store (on ``port``, 0 for any free one) and
    answers ``handle_control``; ``role="decode"`` reads and needs ``control``
    to reach its peers. ``host`` is this engine's address as peers reach it:
    the store is advertised there and the gloo device binds to it, so on a
    cluster it is the node's IP. ``timeout_s`` bounds each read.
    ``new_group`` builds a pairwise group (``new_pair_group`` by default).
    """

    kind = TransportKind.TORCH

    def __init__(self, engine_id: str, *, role: str, host: str = "127.0.0.1", port: int = 0,
                 control: Control | None = None, timeout_s: float = 10.0, new_group: NewGroup = new_pair_group):
        if role not in tuple(Role):
            raise ValueError(f"role must be one of {[r.value for r in Role]}, got {role!r}")
        if role == Role.DECODE and control is None:
            raise ValueError("a decode-side TorchTransport needs control(peer, message) to reach prefill peers")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        super().__init__(engine_id)
        self.role = Role(role)
        self.host = host
        self.timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._control = control
        self._new_group = new_group
        self._store: TCPStore | None = None
        if self.role is Role.PREFILL:
            self._store = TCPStore(host, port, is_master=True, timeout=self._timeout, wait_for_workers=False)
        self._pairs: dict[str, Pair] = {}  # prefill side, by decode engine
        self._notifications: collections.deque[str] = collections.deque()
        self._links: dict[str, Link] = {}  # decode side, by prefill engine
        self._workers_lock = threading.Lock()

    def local_metadata(self) -> bytes:
        pool = self._require_pool()
        port = self._store.port if self._store is not None else 0
        return TorchPeer(name=self.engine_id, role=self.role, host=self.host, port=port,
                         block_bytes=self._block_bytes, num_blocks=pool.shape[0], num_heads=self._num_heads,
                         device=pool.device.type).encode()

    # -- decode side -----------------------------------------------------------

    def _decode_peer(self, metadata: bytes) -> TorchPeer:
        peer = TorchPeer.decode(metadata)
        if self.role is Role.DECODE and peer.role is not Role.PREFILL:
            raise TransferError(f"a decode engine reads from prefill peers; {peer.name!r} is {peer.role.value}")
        return peer

    def _connect_peer(self, peer: TorchPeer) -> None:
        """Links start on the first read."""

    def _forget_peer(self, name: str) -> None:
        with self._workers_lock:
            link = self._links.pop(name, None)
        if link is not None:
            link.stop(f"peer {name!r} restarted")

    def _notify(self, peer: TorchPeer, notify: str) -> None:
        self._link(peer).notify(notify)

    def read_blocks(self, peer, remote_block_ids, local_block_ids, notify) -> TransferHandle:
        if self.role is not Role.DECODE:
            raise TransferError("only a decode-side TorchTransport reads blocks")
        return super().read_blocks(peer, remote_block_ids, local_block_ids, notify)

    def _read(self, peer: TorchPeer, runs: list[Run], notify: str) -> TransferHandle:
        device = self._pool.device.type
        if peer.device != device:
            raise TransferError(f"peer {peer.name!r} has a {peer.device} pool, ours is {device}")
        read = TorchRead(peer.name, len(runs), time.monotonic() + self.timeout_s)
        self._link(peer).submit(read, runs, notify)
        return read

    def _link(self, peer: TorchPeer) -> Link:
        with self._workers_lock:
            link = self._links.get(peer.name)
            if link is None:
                link = self._links[peer.name] = Link(self.engine_id, peer, self._pool, self._control,
                                                     self._new_group, self.host, self.timeout_s)
            return link

    # -- prefill side ----------------------------------------------------------

    def handle_control(self, message: bytes) -> bytes:
        """Answer a decode transport's control message with an encoded ``TorchReply``.

        Never raises for a bad message: the reply carries the error. Work is
        queued on the pair's thread, so this returns at once.
        """
        try:
            if self._closed or self.role is not Role.PREFILL or self._pool is None:
                raise TransferError(f"{self.engine_id} does not serve reads (closed, decode role, or no pool)")
            request = decode_one_of(message, (TorchConnect, TorchSend))
            if isinstance(request, TorchConnect):
                self._on_connect(request)
            else:
                self._on_send(request)
        except (TransferError, WireError) as exc:
            return TorchReply(ok=False, error=str(exc)).encode()
        return TorchReply(ok=True).encode()

    def _on_connect(self, request: TorchConnect) -> None:
        device = self._pool.device.type
        if request.device != device:
            raise TransferError(f"{request.decode!r} has a {request.device} pool, {self.engine_id!r} a {device} one")
        store = PrefixStore(request.group, self._store)

        def make_group(rank: int):
            return self._new_group(store, rank, self._pool.device, self.host, self._timeout)

        pair = Pair(request.decode, request.group, make_group, self._pool, self._notifications.append,
                    self._forget_pair)
        with self._workers_lock:
            old = self._pairs.get(request.decode)
            self._pairs[request.decode] = pair
        if old is not None:
            old.stop()
        pair.start()

    def _on_send(self, request: TorchSend) -> None:
        num_blocks = self._pool.shape[0]
        bad = [b for b in request.block_ids if b >= num_blocks]
        if bad:
            raise TransferError(f"block ids {bad[:8]} are outside this pool of {num_blocks} blocks")
        runs = request.runs()
        if not runs:  # nothing to move: the reader only releases the lease
            self._notifications.append(request.request_id)
            return
        with self._workers_lock:
            pair = self._pairs.get(request.decode)
        if pair is None or pair.group != request.group:
            raise TransferError(f"{self.engine_id} has no group {request.group!r} with {request.decode!r}; reconnect")
        pair.submit(request.request_id, runs, request.first_tag)

    def _forget_pair(self, pair: Pair) -> None:
        with self._workers_lock:
            if self._pairs.get(pair.decode) is pair:
                del self._pairs[pair.decode]

    def poll_notifications(self) -> list[str]:
        notifications = []
        while self._notifications:
            notifications.append(self._notifications.popleft())
        return notifications

    # -- teardown --------------------------------------------------------------

    def close(self) -> None:
        with self._workers_lock:
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
