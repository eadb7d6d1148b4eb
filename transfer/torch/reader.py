"""Decode side of the torch backend: one ``Link`` per prefill peer, running its reads in order.

A read's phases: queued -> receiving -> DONE or FAILED. Its deadline fails it
at once unless it is receiving; a receive is bounded by the same deadline in
the link's thread. Once receives are posted into the pool, the read is not
quiesced (``transfer.base``) until each has completed, or its connection was
closed: a gloo wait that times out closes the pair, and on any failure the
link drops its works and its group, which closes the connection. Giving the
read up (``release``) changes nothing of that: its blocks stay the owner's
until ``quiesced()``.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
import uuid
from typing import Callable

import torch
from torch.distributed import PrefixStore, TCPStore

from transfer.base import Run, TransferError, TransferHandle, TransferState
from transfer.torch.group import DECODE_RANK, PREFILL_RANK, TAG_LIMIT, abort_group
from transfer.torch.messages import TorchConnect, TorchPeer, TorchReply, TorchSend
from transfer.wire import WireMessage

logger = logging.getLogger(__name__)

Control = Callable[[str, bytes], bytes]
# new_group(store, rank, device, host, timeout) -> a two-rank process group
NewGroup = Callable[..., object]


class TorchRead(TransferHandle):
    """A read run by a link's thread; see the module docstring."""

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

    def quiesced(self) -> bool:
        with self._lock:
            return not self._receiving

    def fail(self, error: str) -> None:
        with self._lock:
            if self._state is TransferState.PENDING:
                self._state, self._error = TransferState.FAILED, error

    def is_pending(self) -> bool:
        return self.poll() is TransferState.PENDING

    def start_receiving(self) -> bool:
        """Enter the receiving phase; False if the read already ended (deadline, release)."""
        with self._lock:
            if self._state is not TransferState.PENDING or time.monotonic() >= self.deadline:
                return False
            self._receiving = True
            return True

    def finish_receiving(self, error: str | None) -> None:
        """No byte can land any more: every receive completed (``error`` None) or the connection is closed."""
        with self._lock:
            self._receiving = False
            if self._state is TransferState.PENDING:
                self._state = TransferState.DONE if error is None else TransferState.FAILED
                self._error = error


class Link:
    """One prefill peer's pairwise group and the thread that runs reads from it, in order.

    ``control(peer, message) -> reply`` reaches the peer's ``handle_control``.
    """

    def __init__(self, engine_id: str, peer: TorchPeer, pool: torch.Tensor, control: Control,
                 new_group: NewGroup, host: str, timeout_s: float):
        self.engine_id = engine_id
        self.peer = peer
        self._pool = pool
        self._timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        # How to reach the peer, and to build a group with it.
        self._control = control
        self._new_group = new_group
        self._host = host
        # The current group, if any; a failed read drops it and the next read builds a new one.
        self._group_name: str | None = None
        self._group = None
        self._next_tag = 0
        self._queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"kv-link-{peer.name}", daemon=True)
        self.thread.start()

    def submit(self, read: TorchRead, runs: list[Run], notify: str) -> None:
        self._queue.put((read, runs, notify))

    def notify(self, notify: str) -> None:
        """Tell the peer ``notify`` is done though no block moves (it frees the lease)."""
        self._queue.put((None, [], notify))

    def stop(self, reason: str) -> None:
        while True:  # reads still queued will never run
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0] is not None:
                item[0].fail(reason)
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            read, runs, notify = item
            if read is None:
                self._notify(notify)
                continue
            try:
                self._read(read, runs, notify)
            except Exception as exc:  # noqa: BLE001 - a failed read only fails itself
                self._drop_group()
                read.fail(f"read from {self.peer.name!r} failed: {type(exc).__name__}: {exc}")
        self._drop_group()

    def _notify(self, notify: str) -> None:
        try:
            self._call(self._send_message(notify, [], first_tag=0))
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own; nothing is lost
            logger.warning("%s: notifying %s of %s failed: %s", self.engine_id, self.peer.name, notify, exc)

    def _read(self, read: TorchRead, runs: list[Run], notify: str) -> None:
        if not read.is_pending():
            return
        if self._group is None:
            self._connect()
            if not read.is_pending():
                return
        first_tag = self._next_tag
        self._next_tag = (self._next_tag + len(runs)) % TAG_LIMIT
        self._call(self._send_message(notify, runs, first_tag))
        if not read.start_receiving():  # gave up while the peer may be sending: that group is spoiled
            self._drop_group()
            return
        read.finish_receiving(self._receive(read, runs, first_tag))

    def _receive(self, read: TorchRead, runs: list[Run], first_tag: int) -> str | None:
        """Post and wait for every run; None when all landed, else why not (the connection is then closed)."""
        works = []
        try:
            for i, (_, local, n) in enumerate(runs):
                works.append(self._group.recv([self._pool[local : local + n]], PREFILL_RANK, (first_tag + i) % TAG_LIMIT))
            for work in works:
                remaining = read.deadline - time.monotonic()
                if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                    raise TransferError(f"receive still pending after {self._timeout_s}s")
            return None
        except Exception as exc:  # noqa: BLE001 - closing the connection ends every posted receive
            works.clear()  # the works hold the receive buffers: drop them with the group
            self._drop_group()
            return f"read from {self.peer.name!r} failed: {type(exc).__name__}: {exc}"

    def _send_message(self, request_id: str, runs: list[Run], first_tag: int) -> TorchSend:
        return TorchSend(
            decode=self.engine_id, group=self._group_name or "", request_id=request_id,
            block_ids=tuple(b for remote, _, n in runs for b in range(remote, remote + n)),
            run_lengths=tuple(n for _, _, n in runs), first_tag=first_tag,
        )

    def _connect(self) -> None:
        self._group_name = f"kv/{self.peer.name}/{self.engine_id}/{uuid.uuid4().hex}"
        store = TCPStore(self.peer.host, self.peer.port, is_master=False, timeout=self._timeout)
        self._call(TorchConnect(decode=self.engine_id, group=self._group_name, device=self._pool.device.type))
        self._group = self._new_group(PrefixStore(self._group_name, store), DECODE_RANK, self._pool.device,
                                      self._host, self._timeout)

    def _call(self, message: WireMessage) -> None:
        reply = TorchReply.decode(self._control(self.peer.name, message.encode()))
        if not reply.ok:
            raise TransferError(f"{self.peer.name!r} refused {message.KIND}: {reply.error}")

    def _drop_group(self) -> None:
        group, self._group, self._group_name = self._group, None, None
        abort_group(group)
