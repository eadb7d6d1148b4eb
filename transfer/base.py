"""The transport interface that moves KV blocks between two engines' pools.

The decode side pulls: it reads blocks out of the prefill side's pool into
its own. The prefill side learns a read finished through a notification that
carries the request id, so it frees exactly that request's pinned blocks.
"""

from __future__ import annotations

import abc
import enum
import numbers
from typing import Sequence

import torch


class TransferError(RuntimeError):
    """A transfer failed or could not start; the caller recomputes instead."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferHandle(abc.ABC):
    """One in-flight read. ``poll`` never blocks; ``wait`` blocks up to a timeout."""

    @abc.abstractmethod
    def poll(self) -> TransferState: ...

    @property
    @abc.abstractmethod
    def error(self) -> str | None:
        """Why the transfer failed, once ``poll`` says FAILED."""

    def wait(self, timeout: float) -> TransferState:
        import time

        deadline = time.monotonic() + timeout
        while (state := self.poll()) is TransferState.PENDING:
            if time.monotonic() >= deadline:
                return TransferState.PENDING
            time.sleep(0.0005)
        return state

    @abc.abstractmethod
    def release(self) -> None:
        """Free the handle's resources; idempotent. Cancels it if still pending."""


class KVTransport(abc.ABC):
    """Moves whole blocks of a block-major KV pool ``[num_blocks, ...]``.

    Each block is one contiguous byte range, so a run of consecutive block
    ids is one contiguous range too.
    """

    kind: str

    @abc.abstractmethod
    def register(self, kv_cache: torch.Tensor) -> None:
        """Register this engine's whole KV pool, once."""

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """What a peer needs to reach this pool (sent inline in ``KVHandle``)."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its ``local_metadata()``; returns its name.

        Idempotent; new metadata under a known name (a restarted peer) replaces the old.
        """

    @abc.abstractmethod
    def read_blocks(
        self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], notify: str
    ) -> TransferHandle:
        """Start copying ``peer``'s blocks into ours, pairwise; ``notify`` reaches the peer when done."""

    @abc.abstractmethod
    def poll_notifications(self) -> list[str]:
        """Prefill side: the ``notify`` strings of reads completed since the last call."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""


def block_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge a pairwise block list into ``(remote_start, local_start, num_blocks)`` runs.

    A run grows while both sides' ids advance by one:

        remote: 7 8 9 4 5      local: 0 1 2 3 9
        runs:   (7, 0, 3) (4, 3, 1) (5, 9, 1)
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote blocks but {len(local_block_ids)} local blocks")
    runs: list[tuple[int, int, int]] = []
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
) -> list[tuple[int, int, int]]:
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
