"""Pulling a prompt's KV between engines of different tensor-parallel splits.

Every rank of the decode engine reads exactly the KV heads it owns, from the
prefill ranks that hold them (``pd.model.tp.kv_head_sources``), one NIXL
descriptor per block and source (``HeadSlice``). Rank 0 (this process) reads
its part itself; each other rank is sent a ``Pull`` and answers ``PullDone``
once its reads have ended and can no longer write. The parts make one
``TransferHandle`` (``SplitPull``) for the engine's ``KVConnector``, with the
same promises as one read: DONE when every part is; FAILED (and the rest
released) when any fails; quiesced when every part is.

No part's read notifies the prefill engine. Its lease ends on one
notification, sent to its rank 0 once every part is DONE: a notification per
part would free the prompt's blocks while other parts still read them.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable

from pd.engine.tp.driver import Pull, Release, TPWorkers
from pd.model.config import ModelConfig
from pd.model.tp import SINGLE, TPShard, kv_head_sources
from transfer.base import HeadSlice, KVTransport, TransferHandle, TransferState
from transfer.wire import KVHandle

logger = logging.getLogger(__name__)

_pull_ids = itertools.count()


class WorkerPart(TransferHandle):
    """A worker rank's part of a pull, as its ``PullDone`` tells it."""

    def __init__(self, workers: TPWorkers, rank: int, pull_id: int):
        self.workers, self.rank, self.pull_id = workers, rank, pull_id
        self._done = None
        self._released = False
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        return self._error

    def poll(self) -> TransferState:
        if self._done is None:
            self._done = self.workers.take_pull_done(self.rank, self.pull_id)
            if self._done is not None and not self._done.ok:
                self._error = f"rank {self.rank}: {self._done.error}"
        if self._done is None:
            return TransferState.FAILED if self._released else TransferState.PENDING
        return TransferState.DONE if self._done.ok and not self._released else TransferState.FAILED

    def release(self) -> None:
        if self._done is None and not self._released:
            self._released = True
            self._error = self._error or "released while pending"
            self.workers.send_to(self.rank, Release(self.pull_id))

    def quiesced(self) -> bool:
        self.poll()
        return self._done is not None


class SplitPull(TransferHandle):
    """One pull's parts across ranks and sources; on DONE, the prefill engine's lease is notified once."""

    def __init__(self, parts: list[TransferHandle], notify: Callable[[], None], error: str | None = None):
        self.parts = parts
        self._notify = notify
        self._state = TransferState.FAILED if error else TransferState.PENDING
        self._error = error
        if error:
            self.release()

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def num_descriptors(self) -> int:
        return sum(getattr(part, "num_descriptors", 0) for part in self.parts)

    @property
    def moved_bytes(self) -> int | None:
        """The parts' measured bytes summed, where every part measured its own (rank 0's do, workers' do not)."""
        counts = [part.moved_bytes for part in self.parts]
        return None if None in counts else sum(counts)

    def poll(self) -> TransferState:
        if self._state is not TransferState.PENDING:
            return self._state
        states = [part.poll() for part in self.parts]
        if TransferState.FAILED in states:
            self._error = "; ".join(part.error or "failed" for part, state in zip(self.parts, states)
                                    if state is TransferState.FAILED)
            self._state = TransferState.FAILED
            self.release()
        elif all(state is TransferState.DONE for state in states):
            self._state = TransferState.DONE
            try:
                self._notify()
            except Exception as exc:  # noqa: BLE001 - the lease then expires on its own; nothing is lost
                logger.warning("notifying the prefill engine of a finished pull failed: %s", exc)
        return self._state

    def release(self) -> None:
        if self._state is TransferState.PENDING:
            self._state, self._error = TransferState.FAILED, "released while pending"
        for part in self.parts:
            part.release()

    def quiesced(self) -> bool:
        return all(part.quiesced() for part in self.parts)


def start_split_pull(handle: KVHandle, model_config: ModelConfig, transport: KVTransport,
                     workers: TPWorkers | None, local_size: int, peer_of: Callable[[bytes], str],
                     remote_ids: list[int], local_ids: list[int], attention_size: int | None = None) -> SplitPull:
    """Start every rank's reads of ``handle``'s blocks ``remote_ids`` into ``local_ids``.

    ``attention_size``: the local ranks attention is split over (``local_size`` unless given); with 1,
    every rank holds every KV head (expert parallelism with attention whole on each rank), and reads all.
    """
    attention_size = local_size if attention_size is None else attention_size
    sources = [handle.peer_metadata, *handle.rank_metadata]
    source_size = handle.fingerprint.tensor_parallel_size
    pull_id = next(_pull_ids)
    parts: list[TransferHandle] = []
    try:
        for rank in range(local_size):
            runs = kv_head_sources(model_config, source_size,
                                   TPShard(rank, attention_size) if attention_size > 1 else SINGLE)
            if rank == 0:
                for source, remote_head, local_head, count in runs:
                    parts.append(transport.read_blocks(peer_of(sources[source]), remote_ids, local_ids, notify="",
                                                       heads=HeadSlice(remote_head, local_head, count)))
            else:
                workers.send_to(rank, Pull(pull_id, [(sources[s], r, h, c) for s, r, h, c in runs],
                                           list(remote_ids), list(local_ids)))
                parts.append(WorkerPart(workers, rank, pull_id))
    except Exception as exc:  # noqa: BLE001 - the parts started still count until quiesced
        return SplitPull(parts, lambda: None, error=f"starting the pull failed: {exc}")
    owner = peer_of(sources[0])
    return SplitPull(parts, lambda: transport.notify(owner, handle.request_id))
