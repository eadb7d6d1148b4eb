"""The NIXL backend: one-sided READs of KV blocks over UCX.

Each engine owns one NIXL agent named after its engine id, with no listen
thread (it would bind every interface, and metadata travels inline in the
``KVHandle`` instead). The whole pool is registered once: DRAM for a CPU
pool, VRAM for a CUDA pool, so the same code is shared memory or TCP on one
machine and GPU-direct RDMA on a cluster.

Both the local pool and each peer's pool are prepared once as per-block
descriptor lists; a read picks blocks by index and NIXL merges consecutive
indices into one descriptor, so a read posts one descriptor per run of
consecutive block ids (see ``block_runs``):

    pool:   | b0 | b1 | b2 | b3 | ...      block b = bytes [b * block_bytes, (b + 1) * block_bytes)
    read remote [7 8 9 4] into local [0 1 2 3]  ->  descriptors (7..9 -> 0..2), (4 -> 3)

The prefill side never acts during a read; it learns that one finished from
the notification NIXL delivers after the data, which carries the request id.
It cannot see a read in flight, so a prefill lease must outlast the reader's
``timeout_s`` after the reader starts: the reader cancels a read at that
deadline, and a dead peer fails a read at once (UCX reports the disconnect).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from transfer.base import KVTransport, TransferError, TransferHandle, TransferState, check_read, pool_geometry
from transfer.wire import WireError, decode_message, encode_message, require_field

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the NIXL transfer backend needs NIXL: pip install nixl") from exc

logger = logging.getLogger(__name__)

PEER_KIND = "nixl_peer"
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class NixlPeer:
    """A pool reachable over NIXL: what ``local_metadata()`` carries."""

    name: str
    agent_metadata: bytes
    base_address: int
    block_bytes: int
    num_blocks: int
    mem_type: str
    device_id: int

    def encode(self) -> bytes:
        return encode_message(PEER_KIND, {
            "name": self.name, "agent_metadata": self.agent_metadata, "base_address": self.base_address,
            "block_bytes": self.block_bytes, "num_blocks": self.num_blocks, "mem_type": self.mem_type,
            "device_id": self.device_id,
        })

    @classmethod
    def decode(cls, data: bytes) -> "NixlPeer":
        body = decode_message(data, PEER_KIND)
        peer = cls(
            name=require_field(body, "name", str),
            agent_metadata=require_field(body, "agent_metadata", bytes),
            base_address=require_field(body, "base_address", int),
            block_bytes=require_field(body, "block_bytes", int),
            num_blocks=require_field(body, "num_blocks", int),
            mem_type=require_field(body, "mem_type", str),
            device_id=require_field(body, "device_id", int),
        )
        if peer.mem_type not in MEM_TYPES:
            raise WireError(f"nixl_peer.mem_type {peer.mem_type!r} is not one of {MEM_TYPES}")
        if not peer.name or peer.block_bytes < 1 or peer.num_blocks < 1 or peer.base_address < 1 or peer.device_id < 0:
            raise WireError(f"nixl_peer {peer.name!r} has an empty name or a non-positive size or address")
        return peer

    def block_descriptors(self) -> np.ndarray:
        """One ``(address, length, device)`` row per block, in block-id order."""
        return _block_descriptors(self.base_address, self.block_bytes, self.num_blocks, self.device_id)


class NixlTransport(KVTransport):
    """KV transport over a NIXL agent named ``engine_id``.

    ``timeout_s`` bounds every read: a read still in flight after it is
    cancelled and reported FAILED. The agent is not thread-safe on its own,
    so every call into it holds one lock.
    """

    kind = "nixl"

    def __init__(self, engine_id: str, *, backends: Sequence[str] = ("UCX",), timeout_s: float = 10.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self._backends = list(backends)
        self._lock = threading.RLock()
        self._agent = nixl_agent(engine_id, nixl_agent_config(enable_listen_thread=False, backends=self._backends))
        self._local: NixlPeer | None = None
        self._reg_descs = None
        self._local_dlist = None
        self._peers: dict[str, NixlPeer] = {}
        self._peer_dlists: dict = {}
        self._handles: set[_NixlReadHandle] = set()
        self._unreleased: list = []  # xfer handles NIXL refused to cancel; retried on close
        self._closed = False

    # -- setup ---------------------------------------------------------------

    def register(self, kv_cache: torch.Tensor) -> None:
        self._check_open()
        if self._local is not None:
            raise TransferError(f"{self.engine_id}: the KV pool is already registered")
        num_blocks, block_bytes = pool_geometry(kv_cache)
        is_cuda = kv_cache.device.type == "cuda"
        mem_type = "VRAM" if is_cuda else "DRAM"
        device_id = kv_cache.device.index if is_cuda else 0
        with self._lock:
            self._reg_descs = self._agent.register_memory(
                [(kv_cache.data_ptr(), num_blocks * block_bytes, device_id, "")], mem_type
            )
            self._local = NixlPeer(
                name=self.engine_id, agent_metadata=self._agent.get_agent_metadata(),
                base_address=kv_cache.data_ptr(), block_bytes=block_bytes, num_blocks=num_blocks,
                mem_type=mem_type, device_id=device_id,
            )
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._local.block_descriptors(), mem_type)
        self._kv_cache = kv_cache  # keeps the registered memory alive

    def local_metadata(self) -> bytes:
        return self._require_local().encode()

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        peer = NixlPeer.decode(metadata)
        local = self._require_local()
        if peer.name == self.engine_id:
            raise TransferError(f"{self.engine_id}: a peer cannot have this engine's own name")
        with self._lock:
            known = self._peers.get(peer.name)
            if known == peer:
                return peer.name
            if known is not None:  # restarted under the same name: forget the old agent first
                logger.info("%s: peer %s changed its metadata; replacing it", self.engine_id, peer.name)
                self._forget_peer(peer.name)
            loaded = self._agent.add_remote_agent(peer.agent_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != peer.name:
                self._agent.remove_remote_agent(loaded)
                raise TransferError(f"peer metadata names {peer.name!r} but its NIXL agent is {loaded!r}")
            try:
                self._peer_dlists[peer.name] = self._agent.prep_xfer_dlist(
                    peer.name, peer.block_descriptors(), peer.mem_type
                )
            except Exception:
                self._agent.remove_remote_agent(peer.name)
                raise
            self._peers[peer.name] = peer
        if peer.block_bytes != local.block_bytes:
            logger.warning("%s: peer %s has %d-byte blocks, ours are %d", self.engine_id, peer.name,
                           peer.block_bytes, local.block_bytes)
        return peer.name

    # -- reads ---------------------------------------------------------------

    def read_blocks(
        self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], notify: str
    ) -> TransferHandle:
        self._check_open()
        local = self._require_local()
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"{self.engine_id}: unknown peer {peer!r}; add_peer its metadata first")
        if remote.block_bytes != local.block_bytes:
            raise TransferError(f"peer {peer!r} has {remote.block_bytes}-byte blocks, ours are {local.block_bytes}")
        runs = check_read(remote_block_ids, local_block_ids, peer=peer, remote_num_blocks=remote.num_blocks,
                          engine=self.engine_id, local_num_blocks=local.num_blocks)
        notif = notify.encode()
        with self._lock:
            if not runs:  # nothing to move (all prefix hits); the owner still frees its lease
                try:
                    self._agent.send_notif(peer, notif)
                except Exception as exc:  # the lease expires on its own; the decode side has all it needs
                    logger.warning("%s: notifying %s of %s failed: %s", self.engine_id, peer, notify, exc)
                return _FinishedHandle()
            xfer = self._agent.make_prepped_xfer(
                "READ", self._local_dlist, [int(b) for b in local_block_ids], self._peer_dlists[peer],
                [int(b) for b in remote_block_ids], notif_msg=notif,
            )
            handle = _NixlReadHandle(self, xfer, peer, len(runs), time.monotonic() + self.timeout_s)
            try:
                status = self._agent.transfer(xfer)
            except Exception as exc:
                handle._finish(TransferState.FAILED, f"posting the read from {peer!r} failed: {exc}")
                return handle
            if status == "ERR":
                handle._finish(TransferState.FAILED, f"posting the read from {peer!r} failed")
            else:
                self._handles.add(handle)
        return handle

    def poll_notifications(self) -> list[str]:
        if self._closed:
            return []
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [message.decode(errors="replace") for messages in notifs.values() for message in messages]

    # -- teardown ------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in list(self._handles):
                handle.release()
            for name in list(self._peers):
                self._forget_peer(name)
            for xfer in self._unreleased:
                _try_release(xfer)
            self._unreleased.clear()
            if self._local_dlist is not None:
                self._local_dlist.release()
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs)
            self._local_dlist = self._reg_descs = self._local = None
            self._kv_cache = None
            self._agent = None

    def _forget_peer(self, name: str) -> None:
        dlist = self._peer_dlists.pop(name, None)
        if dlist is not None:
            dlist.release()
        self._peers.pop(name, None)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone on NIXL's side; nothing left to undo
            logger.warning("%s: removing peer %s: %s", self.engine_id, name, exc)

    def _require_local(self) -> NixlPeer:
        self._check_open()
        if self._local is None:
            raise TransferError(f"{self.engine_id}: register the KV pool first")
        return self._local

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.engine_id}: the transport is closed")


class _NixlReadHandle(TransferHandle):
    """A posted READ; polling checks NIXL and frees the request once it ends."""

    def __init__(self, transport: NixlTransport, xfer, peer: str, num_descriptors: int, deadline: float):
        self._transport = transport
        self._xfer = xfer
        self._peer = peer
        self.num_descriptors = num_descriptors
        self._deadline = deadline
        self._state = TransferState.PENDING
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        return self._error

    def poll(self) -> TransferState:
        if self._state is not TransferState.PENDING:
            return self._state
        with self._transport._lock:
            if self._state is not TransferState.PENDING:
                return self._state
            try:
                status = self._transport._agent.check_xfer_state(self._xfer)
            except Exception as exc:
                status, detail = "ERR", f": {exc}"
            else:
                detail = ""
            if status == "DONE":
                self._finish(TransferState.DONE, None)
            elif status == "ERR":
                self._finish(TransferState.FAILED, f"NIXL read from {self._peer!r} failed{detail}")
            elif time.monotonic() >= self._deadline:
                self._finish(TransferState.FAILED,
                             f"NIXL read from {self._peer!r} still pending after {self._transport.timeout_s}s")
        return self._state

    def release(self) -> None:
        with self._transport._lock:
            if self._state is TransferState.PENDING:
                self._finish(TransferState.FAILED, "released while pending")

    def _finish(self, state: TransferState, error: str | None) -> None:
        """End the handle and free (or, if still in flight, cancel) the NIXL request."""
        self._state, self._error = state, error
        self._transport._handles.discard(self)
        if not _try_release(self._xfer):
            self._transport._unreleased.append(self._xfer)
        self._xfer = None


class _FinishedHandle(TransferHandle):
    """A read with no blocks to move."""

    error = None

    def poll(self) -> TransferState:
        return TransferState.DONE

    def release(self) -> None:
        pass


def _block_descriptors(base_address: int, block_bytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    rows = np.empty((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    rows[:, 2] = device_id
    return rows


def _try_release(xfer) -> bool:
    try:
        xfer.release()
        return True
    except Exception as exc:  # NIXL could not cancel an active request
        logger.warning("could not release a NIXL transfer request: %s", exc)
        return False
