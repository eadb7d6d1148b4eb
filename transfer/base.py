"""The transport interface that moves KV blocks between two engines' pools.

The decode side pulls: it reads blocks out of the prefill side's pool into
its own. The prefill side learns a read finished through a notification that
carries the request id, so it frees exactly that request's pinned blocks.

The one invariant every backend keeps, and every caller relies on:

    Bytes of a read land only in the local blocks it names, and only until
    the read is *quiesced*. A read is quiesced once ``quiesced()`` says so:
    at once when it is DONE or never started moving bytes; after a failure,
    a timeout or ``release()``, only when the backend can prove no byte can
    still arrive. ``release()`` never blocks, so it does not end the read by
    itself. Whoever owns the local blocks keeps them out of the free list
    until ``quiesced()`` is True (the engine's ``KVConnector`` holds a
    reference on them for exactly that long).

Each backend's proof: NIXL, the request has left ``PROC`` (done or failed) and
was freed; a NIXL cancel that "succeeds" on a request in flight does not stop
UCX from writing later, so an active request is never cancelled. torch, every
receive posted for the read has completed, or its connection was closed (the
group's timeout closes it).
"""

from __future__ import annotations

import abc
import enum
import logging
import numbers
import threading
import time
from typing import TYPE_CHECKING, Callable, Generic, NamedTuple, Sequence, TypeVar

from transfer.wire import PoolMetadata, TransportKind

if TYPE_CHECKING:  # the ingress imports this package for its wire types, and loads no torch
    import torch

logger = logging.getLogger(__name__)

# (remote_start, local_start, num_blocks): a run of consecutive block ids on both sides.
Run = tuple[int, int, int]


class HeadSlice(NamedTuple):
    """Heads ``[remote_start, remote_start + count)`` of each remote block into ``[local_start, ...)`` of ours.

    A block's heads are its outermost slices (``PoolMetadata.num_heads``), so
    each is one contiguous range: a read of a slice is one descriptor per block.
    """

    remote_start: int
    local_start: int
    count: int


class TransferError(RuntimeError):
    """A transfer failed or could not start; the caller recomputes instead."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferHandle(abc.ABC):
    """One in-flight read. ``poll`` and ``quiesced`` never block; ``wait`` blocks up to a timeout."""

    # The bytes the backend says this read moved, once DONE (NIXL: its own telemetry of the request);
    # None where a backend does not report them.
    moved_bytes: int | None = None

    @abc.abstractmethod
    def poll(self) -> TransferState: ...

    @property
    @abc.abstractmethod
    def error(self) -> str | None:
        """Why the transfer failed, once ``poll`` says FAILED."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the read up (FAILED if still pending); idempotent, never blocks. See ``quiesced``."""

    @abc.abstractmethod
    def quiesced(self) -> bool:
        """True once no byte of this read can land in its local blocks any more (module docstring)."""

    def wait(self, timeout: float) -> TransferState:
        deadline = time.monotonic() + timeout
        while (state := self.poll()) is TransferState.PENDING:
            if time.monotonic() >= deadline:
                return TransferState.PENDING
            time.sleep(0.0005)
        return state


class FinishedHandle(TransferHandle):
    """A read with no blocks to move."""

    error = None

    def poll(self) -> TransferState:
        return TransferState.DONE

    def release(self) -> None:
        pass

    def quiesced(self) -> bool:
        return True


class DelayedRead(TransferHandle):
    """Fault injection: a read posted ``delay_s`` after it was asked for, as over a link that stalled.

    ``issue`` posts the real read when the delay has passed, at a ``poll``;
    until then the read is pending, and giving it up posts nothing.
    """

    def __init__(self, issue: Callable[[], TransferHandle], delay_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._issue = issue
        self._clock = clock
        self._post_at = clock() + delay_s
        self._read: TransferHandle | None = None
        self._released = False

    @property
    def moved_bytes(self) -> int | None:  # type: ignore[override]
        return None if self._read is None else self._read.moved_bytes

    @property
    def num_descriptors(self) -> int:
        return getattr(self._read, "num_descriptors", 0)

    @property
    def error(self) -> str | None:
        if self._read is not None:
            return self._read.error
        return "given up before it was posted" if self._released else None

    def poll(self) -> TransferState:
        if self._read is None:
            if self._released:
                return TransferState.FAILED
            if self._clock() < self._post_at:
                return TransferState.PENDING
            self._read = self._issue()
        return self._read.poll()

    def release(self) -> None:
        self._released = True
        if self._read is not None:
            self._read.release()

    def quiesced(self) -> bool:
        return self._read is None or self._read.quiesced()


P = TypeVar("P", bound=PoolMetadata)


class KVTransport(abc.ABC, Generic[P]):
    """Moves whole blocks of a block-major KV pool ``[num_blocks, ...]``.

    Each block is one contiguous byte range, so a run of consecutive block
    ids is one contiguous range too. This class does what every backend does
    before a byte moves (unknown peers, block sizes, ids, empty reads,
    restarted peers); a backend supplies the ``_``-prefixed steps.
    """

    kind: TransportKind

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self._lock = threading.RLock()
        self._peers: dict[str, P] = {}
        self._pool: torch.Tensor | None = None
        self._block_bytes = 0
        self._num_heads = 1
        self._closed = False

    def register(self, kv_cache: torch.Tensor, num_heads: int = 1) -> None:
        """Register this engine's whole KV pool, once; each block is ``num_heads`` equal slices, outermost."""
        self._check_open()
        if self._pool is not None:
            raise TransferError(f"{self.engine_id}: the KV pool is already registered")
        _, self._block_bytes = pool_geometry(kv_cache)
        if num_heads < 1 or self._block_bytes % num_heads:
            raise TransferError(f"a {self._block_bytes}-byte block does not split into {num_heads} heads")
        self._num_heads = num_heads
        self._register(kv_cache)
        self._pool = kv_cache

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """What a peer needs to reach this pool (sent inline in ``KVHandle``)."""

    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its ``local_metadata()``; returns its name.

        Idempotent; new metadata under a known name (a restarted peer) replaces the old.
        """
        self._check_open()
        peer = self._decode_peer(metadata)
        if peer.name == self.engine_id:
            raise TransferError(f"{self.engine_id}: a peer cannot have this engine's own name")
        with self._lock:
            known = self._peers.get(peer.name)
            if known == peer:
                return peer.name
            if known is not None:  # restarted under the same name: its old state is dead
                logger.info("%s: peer %s changed its metadata; replacing it", self.engine_id, peer.name)
                self._forget_peer(peer.name)
                del self._peers[peer.name]
            self._connect_peer(peer)
            self._peers[peer.name] = peer
        return peer.name

    def read_blocks(
        self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], notify: str,
        heads: HeadSlice | None = None,
    ) -> TransferHandle:
        """Start copying ``peer``'s blocks into ours, pairwise; ``notify`` reaches the peer when done.

        With ``heads``, only that range of each block's heads moves (into its
        range of ours): a peer whose tensor-parallel split differs from ours.
        """
        pool = self._require_pool()
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"{self.engine_id}: unknown peer {peer!r}; add_peer its metadata first")
        if heads is None or self._whole_blocks(remote, heads):
            heads = None
            if remote.block_bytes != self._block_bytes:
                raise TransferError(f"peer {peer!r} has {remote.block_bytes}-byte blocks, ours are {self._block_bytes}")
        else:
            self._check_heads(peer, remote, heads)
        runs = check_read(remote_block_ids, local_block_ids, peer=peer, remote_num_blocks=remote.num_blocks,
                          engine=self.engine_id, local_num_blocks=pool.shape[0])
        if not runs:  # all prefix hits: nothing moves, but the owner still frees its lease
            try:
                self._notify(remote, notify)
            except Exception as exc:  # noqa: BLE001 - the lease expires on its own; nothing is lost
                logger.warning("%s: notifying %s of %s failed: %s", self.engine_id, peer, notify, exc)
            return FinishedHandle()
        return self._read(remote, runs, notify) if heads is None else self._read_heads(remote, runs, notify, heads)

    def _whole_blocks(self, remote: P, heads: HeadSlice) -> bool:
        return heads == HeadSlice(0, 0, self._num_heads) and remote.num_heads == self._num_heads

    def _check_heads(self, peer: str, remote: P, heads: HeadSlice) -> None:
        """Refuse a head range before any byte moves: heads of another size, or outside either block."""
        ours, theirs = self._block_bytes // self._num_heads, remote.block_bytes // remote.num_heads
        if ours != theirs:
            raise TransferError(f"peer {peer!r} has {theirs}-byte heads, ours are {ours}")
        remote_start, local_start, count = heads
        if count < 1 or remote_start < 0 or local_start < 0:
            raise TransferError(f"head range {tuple(heads)} is empty or negative")
        if remote_start + count > remote.num_heads or local_start + count > self._num_heads:
            raise TransferError(f"head range {tuple(heads)} is outside peer {peer!r}'s {remote.num_heads} heads "
                                f"or our {self._num_heads}")

    def notify(self, peer: str, message: str) -> None:
        """Deliver ``message`` to a known peer as a read's notification would (a read done in parts elsewhere)."""
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"{self.engine_id}: unknown peer {peer!r}; add_peer its metadata first")
        self._notify(remote, message)

    @abc.abstractmethod
    def poll_notifications(self) -> list[str]:
        """Prefill side: the ``notify`` strings of reads completed since the last call."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    # -- the backend's steps ---------------------------------------------------

    def _register(self, kv_cache: torch.Tensor) -> None:
        """Make the pool reachable (the base has checked it is block-major)."""

    @abc.abstractmethod
    def _decode_peer(self, metadata: bytes) -> P:
        """The peer a ``local_metadata()`` describes; ``WireError`` or ``TransferError`` if unusable."""

    @abc.abstractmethod
    def _connect_peer(self, peer: P) -> None:
        """Prepare to read from a new peer (under the lock)."""

    @abc.abstractmethod
    def _forget_peer(self, name: str) -> None:
        """Drop what ``_connect_peer`` made (under the lock)."""

    @abc.abstractmethod
    def _notify(self, peer: P, notify: str) -> None:
        """Deliver ``notify`` to a peer when no block moves."""

    @abc.abstractmethod
    def _read(self, peer: P, runs: list[Run], notify: str) -> TransferHandle:
        """Start moving ``runs`` (checked, non-empty) from ``peer``."""

    def _read_heads(self, peer: P, runs: list[Run], notify: str, heads: HeadSlice) -> TransferHandle:
        """Start moving one range of heads of ``runs``' blocks (checked) from ``peer``."""
        raise TransferError(f"the {self.kind.value} backend moves whole blocks only; a peer of another "
                            "tensor-parallel split needs the nixl backend")

    # -- helpers ---------------------------------------------------------------

    def _require_pool(self) -> torch.Tensor:
        self._check_open()
        if self._pool is None:
            raise TransferError(f"{self.engine_id}: register the KV pool first")
        return self._pool

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.engine_id}: the transport is closed")


def block_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[Run]:
    """Merge a pairwise block list into ``(remote_start, local_start, num_blocks)`` runs.

    A run grows while both sides' ids advance by one:

        remote: 7 8 9 4 5      local: 0 1 2 3 9
        runs:   (7, 0, 3) (4, 3, 1) (5, 9, 1)
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote blocks but {len(local_block_ids)} local blocks")
    runs: list[Run] = []
    for remote, local in zip(remote_block_ids, local_block_ids):
        if runs and remote == runs[-1][0] + runs[-1][2] and local == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((remote, local, 1))
    return runs


def pool_geometry(kv_cache: torch.Tensor) -> tuple[int, int]:
    """``(num_blocks, block_bytes)`` of a block-major pool; ``TransferError`` if it is not one."""
    if not kv_cache.is_contiguous() or kv_cache.dim() < 2:
        raise TransferError("the KV pool must be a contiguous block-major tensor [num_blocks, ...]")
    return kv_cache.shape[0], kv_cache[0].numel() * kv_cache.element_size()


def check_read(
    remote_block_ids: Sequence[int], local_block_ids: Sequence[int], *,
    peer: str, remote_num_blocks: int, engine: str, local_num_blocks: int,
) -> list[Run]:
    """Refuse a read before any bytes move; returns its ``block_runs``.

    Ids must be ints inside their pool, and no local block may be written twice.
    """
    for block_ids, num_blocks, owner in (
        (remote_block_ids, remote_num_blocks, f"peer {peer!r}"), (local_block_ids, local_num_blocks, engine)
    ):
        bad = [b for b in block_ids if not _is_block_id(b) or not 0 <= b < num_blocks]
        if bad:
            raise TransferError(f"block ids {bad[:8]} are outside {owner}'s pool of {num_blocks} blocks")
    if len(set(local_block_ids)) != len(local_block_ids):
        raise TransferError("local_block_ids repeat a block; two reads would race into it")
    return block_runs([int(b) for b in remote_block_ids], [int(b) for b in local_block_ids])


def _is_block_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


__all__ = [
    "FinishedHandle", "HeadSlice", "KVTransport", "Run", "TransferError", "TransferHandle", "TransferState",
    "block_runs", "check_read", "pool_geometry",
]
