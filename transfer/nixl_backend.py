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
A read given up (its deadline, or ``release``) while NIXL still reports it in
progress is never cancelled: over UCX a "successful" cancel of an active READ
can still write later (seen with UCX over TCP). It is kept until it leaves
``PROC`` and only then freed; ``quiesced`` reports that (``transfer.base``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import ClassVar, Sequence

import numpy as np
import torch

from transfer.base import HeadSlice, KVTransport, Run, TransferError, TransferHandle, TransferState
from transfer.nixl_api import make_agent
from transfer.wire import NonNegativeInt, PoolMetadata, PositiveInt, TransportKind

logger = logging.getLogger(__name__)

# While closing, how often to look again at reads still in flight.
CLOSE_POLL_S = 0.005


class MemType(str, enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class NixlPeer(PoolMetadata, frozen=True, kw_only=True):
    """A pool reachable over NIXL: what ``local_metadata()`` carries."""

    KIND: ClassVar[str] = "nixl_peer"

    agent_metadata: bytes  # the NIXL agent's own metadata, loaded with add_remote_agent
    base_address: PositiveInt
    mem_type: MemType
    device_id: NonNegativeInt

    def block_descriptors(self, head_start: int = 0, num_heads: int | None = None) -> np.ndarray:
        """One ``(address, length, device)`` row per block, in block-id order: the whole block, or its heads
        ``[head_start, head_start + num_heads)`` (one contiguous range: heads are outermost in a block)."""
        head_bytes = self.block_bytes // self.num_heads
        count = self.num_heads if num_heads is None else num_heads
        rows = np.empty((self.num_blocks, 3), dtype=np.uint64)
        rows[:, 0] = (self.base_address + head_start * head_bytes
                      + np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.block_bytes))
        rows[:, 1] = count * head_bytes
        rows[:, 2] = self.device_id
        return rows


class _Agent:
    """A NIXL agent behind one lock: the agent is not thread-safe on its own."""

    def __init__(self, name: str, backends: Sequence[str]):
        self.lock = threading.RLock()
        self.nixl = make_agent(name, list(backends))

    def state(self, xfer) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"``."""
        with self.lock:
            try:
                return self.nixl.check_xfer_state(xfer)
            except Exception as exc:  # noqa: BLE001 - NIXL reports a broken request by raising
                logger.warning("checking a NIXL transfer: %s", exc)
                return "ERR"

    def moved_bytes(self, xfer) -> int | None:
        """The bytes a finished request moved, as NIXL's telemetry counts them; None if it cannot say."""
        with self.lock:
            try:
                return int(self.nixl.get_xfer_telemetry(xfer).totalBytes)
            except Exception as exc:  # noqa: BLE001 - telemetry off or refused: the count is unknown, not wrong
                logger.warning("no NIXL telemetry for a finished read: %s", exc)
                return None

    def free(self, xfer) -> bool:
        """Free a request that is no longer in flight; False if NIXL refused."""
        with self.lock:
            try:
                xfer.release()
                return True
            except Exception as exc:  # noqa: BLE001 - NIXL refuses to free an active request
                logger.warning("could not free a NIXL transfer request: %s", exc)
                return False


class NixlTransport(KVTransport[NixlPeer]):
    """KV transport over a NIXL agent named ``engine_id``.

    ``timeout_s`` bounds every read: one still in flight after it is reported
    FAILED (and kept until it leaves ``PROC``; see the module docstring).
    """

    kind = TransportKind.NIXL

    def __init__(self, engine_id: str, *, backends: Sequence[str] = ("UCX",), timeout_s: float = 10.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        super().__init__(engine_id)
        self.timeout_s = timeout_s
        self._agent = _Agent(engine_id, backends)
        self._local: NixlPeer | None = None
        self._reg_descs = None
        self._local_dlist = None
        self._peer_dlists: dict = {}
        # Head ranges of blocks, prepared once per range: ours by (start, count), peers' by (name, start, count).
        self._local_slices: dict = {}
        self._peer_slices: dict = {}
        self._reads: set[_NixlRead] = set()  # every read whose NIXL request is not yet freed

    def _register(self, kv_cache: torch.Tensor) -> None:
        num_blocks, block_bytes = kv_cache.shape[0], self._block_bytes
        is_cuda = kv_cache.device.type == "cuda"
        mem_type = MemType.VRAM if is_cuda else MemType.DRAM
        device_id = kv_cache.device.index if is_cuda else 0
        nixl = self._agent.nixl
        with self._agent.lock:
            self._reg_descs = nixl.register_memory(
                [(kv_cache.data_ptr(), num_blocks * block_bytes, device_id, "")], mem_type.value
            )
            self._local = NixlPeer(
                name=self.engine_id, agent_metadata=nixl.get_agent_metadata(), base_address=kv_cache.data_ptr(),
                block_bytes=block_bytes, num_blocks=num_blocks, num_heads=self._num_heads, mem_type=mem_type,
                device_id=device_id,
            )
            self._local_dlist = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", self._local.block_descriptors(), mem_type.value)

    def local_metadata(self) -> bytes:
        self._require_pool()
        return self._local.encode()

    def _decode_peer(self, metadata: bytes) -> NixlPeer:
        return NixlPeer.decode(metadata)

    def _connect_peer(self, peer: NixlPeer) -> None:
        nixl = self._agent.nixl
        with self._agent.lock:
            loaded = nixl.add_remote_agent(peer.agent_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != peer.name:
                nixl.remove_remote_agent(loaded)
                raise TransferError(f"peer metadata names {peer.name!r} but its NIXL agent is {loaded!r}")
            try:
                self._peer_dlists[peer.name] = nixl.prep_xfer_dlist(
                    peer.name, peer.block_descriptors(), peer.mem_type.value
                )
            except Exception:
                nixl.remove_remote_agent(peer.name)
                raise

    def _forget_peer(self, name: str) -> None:
        with self._agent.lock:
            dlist = self._peer_dlists.pop(name, None)
            if dlist is not None:
                dlist.release()
            for key in [key for key in self._peer_slices if key[0] == name]:
                self._peer_slices.pop(key).release()
            try:
                self._agent.nixl.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001 - already gone on NIXL's side; nothing left to undo
                logger.warning("%s: removing peer %s: %s", self.engine_id, name, exc)

    def _notify(self, peer: NixlPeer, notify: str) -> None:
        with self._agent.lock:
            self._agent.nixl.send_notif(peer.name, notify.encode())

    def _read(self, peer: NixlPeer, runs: list[Run], notify: str) -> TransferHandle:
        return self._post(peer, runs, notify, self._local_dlist, self._peer_dlists[peer.name], len(runs))

    def _read_heads(self, peer: NixlPeer, runs: list[Run], notify: str, heads: HeadSlice) -> TransferHandle:
        """One descriptor per block: a range of heads is contiguous in a block, but blocks lie apart."""
        with self._agent.lock:
            local = self._local_slices.get((heads.local_start, heads.count))
            if local is None:
                local = self._local_slices[(heads.local_start, heads.count)] = self._agent.nixl.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self._local.block_descriptors(heads.local_start, heads.count),
                    self._local.mem_type.value)
            key = (peer.name, heads.remote_start, heads.count)
            remote = self._peer_slices.get(key)
            if remote is None:
                remote = self._peer_slices[key] = self._agent.nixl.prep_xfer_dlist(
                    peer.name, peer.block_descriptors(heads.remote_start, heads.count), peer.mem_type.value)
        return self._post(peer, runs, notify, local, remote, sum(n for _, _, n in runs))

    def _post(self, peer: NixlPeer, runs: list[Run], notify: str, local_dlist, remote_dlist,
              num_descriptors: int) -> TransferHandle:
        remote_ids = [remote + i for remote, _, n in runs for i in range(n)]
        local_ids = [local + i for _, local, n in runs for i in range(n)]
        nixl = self._agent.nixl
        with self._agent.lock:
            xfer = nixl.make_prepped_xfer("READ", local_dlist, local_ids, remote_dlist,
                                          remote_ids, notif_msg=notify.encode())
            read = _NixlRead(self._agent, self._reads, xfer, peer.name, num_descriptors, self.timeout_s)
            self._reads.add(read)
            try:
                posted = nixl.transfer(xfer)
            except Exception as exc:  # noqa: BLE001 - nothing was posted: fail at once
                read.end(TransferState.FAILED, f"posting the read from {peer.name!r} failed: {exc}")
            else:
                if posted == "ERR":
                    read.end(TransferState.FAILED, f"posting the read from {peer.name!r} failed")
        return read

    def poll_notifications(self) -> list[str]:
        if self._closed:
            return []
        with self._agent.lock:
            notifs = self._agent.nixl.get_new_notifs()
        return [message.decode(errors="replace") for messages in notifs.values() for message in messages]

    def close(self) -> None:
        with self._agent.lock:
            if self._closed:
                return
            self._closed = True
        # Reads still in flight write into the pool: wait for them before deregistering it.
        deadline = time.monotonic() + self.timeout_s
        while not all(read.quiesced() for read in list(self._reads)) and time.monotonic() < deadline:
            time.sleep(CLOSE_POLL_S)
        with self._agent.lock:
            for read in list(self._reads):
                read.release()
                logger.warning("%s: closing with a read from %s still in flight", self.engine_id, read.peer)
            for name in list(self._peers):
                self._forget_peer(name)
            self._peers.clear()
            for dlist in self._local_slices.values():
                dlist.release()
            self._local_slices.clear()
            if self._local_dlist is not None:
                self._local_dlist.release()
            if self._reg_descs is not None:
                self._agent.nixl.deregister_memory(self._reg_descs)
            self._local_dlist = self._reg_descs = self._local = None
            self._pool = None


class _NixlRead(TransferHandle):
    """A posted READ. Its NIXL request is freed once it is no longer in flight, never before."""

    def __init__(self, agent: _Agent, live: set, xfer, peer: str, num_descriptors: int, timeout_s: float):
        self.peer = peer
        self.num_descriptors = num_descriptors
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        # The request, and the transport's agent and set of live reads it belongs to.
        self._xfer = xfer
        self._agent = agent
        self._live = live
        self._state = TransferState.PENDING
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        return self._error

    def poll(self) -> TransferState:
        with self._agent.lock:
            if self._state is TransferState.PENDING:
                status = self._agent.state(self._xfer)
                if status == "DONE":
                    self.moved_bytes = self._agent.moved_bytes(self._xfer)
                    self.end(TransferState.DONE, None)
                elif status == "ERR":
                    self.end(TransferState.FAILED, f"NIXL read from {self.peer!r} failed")
                elif time.monotonic() >= self._deadline:
                    self._state = TransferState.FAILED
                    self._error = f"NIXL read from {self.peer!r} still pending after {self._timeout_s}s"
            return self._state

    def release(self) -> None:
        with self._agent.lock:
            if self._state is TransferState.PENDING:
                self._state, self._error = TransferState.FAILED, "released while pending"
            self.quiesced()

    def quiesced(self) -> bool:
        with self._agent.lock:
            if self._xfer is not None and self._agent.state(self._xfer) != "PROC":
                self._free()
            return self._xfer is None

    def end(self, state: TransferState, error: str | None) -> None:
        """The request is no longer in flight: record how it ended and free it."""
        self._state, self._error = state, error
        self._free()

    def _free(self) -> None:
        if self._xfer is not None and self._agent.free(self._xfer):
            self._xfer = None
            self._live.discard(self)
