"""Pulling a prompt's KV between engines of different tensor-parallel splits.

Each KV head the decode engine holds crosses from the prefill engine once.
The first rank holding a head (its *holder*, ``head_holders``) reads it from
the prefill ranks that hold it (``pd.model.tp.kv_head_sources``), one NIXL
descriptor per block and source (``HeadSlice``). A rank that holds the same
heads as a lower rank (they are replicated: MLA's latent, fewer KV heads than
ranks, attention whole on every expert-parallel rank) copies them from that
rank's pool inside the engine, once the reads are done:

    MLA, prefill TP=1 -> decode TP=2         GQA, 2 KV heads, decode TP=4

    prefill r0 --read--> decode r0           prefill --read--> r0 (head 0) --copy--> r1
                            |                        --read--> r2 (head 1) --copy--> r3
                            +--copy--> decode r1

Rank 0 (this process) posts its reads itself; each other rank is sent a
``Pull`` (from prefill ranks, or from its holder for a copy) and answers
``PullDone`` once its reads have ended and can no longer write. The parts make
one ``TransferHandle`` (``SplitPull``) for the engine's ``KVConnector``, with
the same promises as one read: DONE when every rank holds the blocks; FAILED
(and the rest released) when any part fails; quiesced when every part is.

No part's read notifies the prefill engine. Its lease ends on one
notification to its rank 0, sent once every read from it is DONE: a
notification per part would free the prompt's blocks while other parts
still read them. The copies inside the engine need the prefill engine's
blocks no more, so they run after it.
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


def held_heads(model_config: ModelConfig, rank: int, attention_size: int) -> tuple[int, int]:
    """The KV heads ``[start, stop)`` rank ``rank`` holds; ``attention_size`` 1: every rank holds every head."""
    return TPShard(rank, attention_size).kv_heads(model_config) if attention_size > 1 else (0, model_config.num_kv_heads)


def head_holders(model_config: ModelConfig, local_size: int, attention_size: int) -> list[int]:
    """For each of ``local_size`` ranks, the lowest rank holding the same KV heads: itself where its heads are
    its own (split), a lower rank where they are replicated."""
    held = [held_heads(model_config, rank, attention_size) for rank in range(local_size)]
    return [held.index(heads) for heads in held]


def sum_of(counts: list[int | None]) -> int | None:
    """The counts' sum, or None where any is unknown."""
    return None if None in counts else sum(counts)


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

    @property
    def moved_bytes(self) -> int | None:  # type: ignore[override]
        """What the worker's transport measured its reads moved, once DONE."""
        return self._done.moved_bytes if self._done is not None and self._done.ok else None

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
    """One pull's reads across ranks and sources, then its copies of replicated heads inside the engine.

    ``reads`` run at once. When every one is DONE the prefill engine's lease is notified (once), and each of
    ``copies`` is started (it posts one rank's copy and returns its part). DONE when every copy is; FAILED,
    with every part started released and no more started, when any read or copy fails.
    """

    def __init__(self, reads: list[TransferHandle], notify: Callable[[], None],
                 copies: list[Callable[[], TransferHandle]] | None = None, error: str | None = None):
        self.reads = reads
        self.copies: list[TransferHandle] = []  # those started
        self._copy_starts = copies or []
        self._notify = notify
        self._state = TransferState.FAILED if error else TransferState.PENDING
        self._copying = False  # the reads are done, the copies started
        self._error = error
        if error:
            self.release()

    @property
    def parts(self) -> list[TransferHandle]:
        return self.reads + self.copies

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def num_descriptors(self) -> int:
        return sum(getattr(read, "num_descriptors", 0) for read in self.reads)

    @property
    def moved_bytes(self) -> int | None:  # type: ignore[override]
        """The bytes read from the prefill engine, as every rank's transport measured them (NIXL's telemetry);
        None where one did not measure. The copies inside the engine are ``copied_bytes``."""
        return sum_of([read.moved_bytes for read in self.reads])

    @property
    def copied_bytes(self) -> int | None:
        """The bytes the copies of replicated heads moved between this engine's ranks, as measured."""
        return sum_of([copy.moved_bytes for copy in self.copies])

    def poll(self) -> TransferState:
        if self._state is not TransferState.PENDING:
            return self._state
        if not self._copying:
            if not self._settled(self.reads):
                return self._state
            self._end_lease()
            self._copying = True
            try:
                for start in self._copy_starts:
                    self.copies.append(start())
            except Exception as exc:  # noqa: BLE001 - the copies started still count until quiesced
                self._fail(f"starting a copy between ranks failed: {exc}")
                return self._state
        if self._settled(self.copies):
            self._state = TransferState.DONE
        return self._state

    def _settled(self, parts: list[TransferHandle]) -> bool:
        """True when every part is DONE; on a failed part, the pull fails."""
        states = [part.poll() for part in parts]
        if TransferState.FAILED in states:
            self._fail("; ".join(part.error or "failed" for part, state in zip(parts, states)
                                 if state is TransferState.FAILED))
            return False
        return all(state is TransferState.DONE for state in states)

    def _fail(self, error: str) -> None:
        self._state, self._error = TransferState.FAILED, error
        self.release()

    def _end_lease(self) -> None:
        try:
            self._notify()
        except Exception as exc:  # noqa: BLE001 - the lease then expires on its own; nothing is lost
            logger.warning("notifying the prefill engine of a finished pull failed: %s", exc)

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
    """Start the holders' reads of ``handle``'s blocks ``remote_ids`` into ``local_ids``; the other ranks'
    copies start once those are done (``SplitPull``).

    ``attention_size``: the local ranks attention is split over (``local_size`` unless given); with 1,
    every rank holds every KV head (expert parallelism with attention whole on each rank).
    """
    attention_size = local_size if attention_size is None else attention_size
    sources = [handle.peer_metadata, *handle.rank_metadata]
    source_size = handle.fingerprint.tensor_parallel_size
    holders = head_holders(model_config, local_size, attention_size)
    pull_id = next(_pull_ids)
    reads: list[TransferHandle] = []
    try:
        for rank in (rank for rank in range(local_size) if holders[rank] == rank):
            shard = TPShard(rank, attention_size) if attention_size > 1 else SINGLE
            runs = kv_head_sources(model_config, source_size, shard)
            if rank == 0:
                for source, remote_head, local_head, count in runs:
                    reads.append(transport.read_blocks(peer_of(sources[source]), remote_ids, local_ids, notify="",
                                                       heads=HeadSlice(remote_head, local_head, count)))
            else:
                workers.send_to(rank, Pull(pull_id, [(sources[s], r, h, c) for s, r, h, c in runs],
                                           list(remote_ids), list(local_ids)))
                reads.append(WorkerPart(workers, rank, pull_id))
    except Exception as exc:  # noqa: BLE001 - the parts started still count until quiesced
        return SplitPull(reads, lambda: None, error=f"starting the pull failed: {exc}")
    copies = [_copy_start(workers, rank, holders[rank], transport, model_config, attention_size, pull_id, local_ids)
              for rank in range(local_size) if holders[rank] != rank and local_ids]
    owner = peer_of(sources[0])
    return SplitPull(reads, lambda: transport.notify(owner, handle.request_id), copies)


def _copy_start(workers: TPWorkers, rank: int, holder: int, transport: KVTransport, model_config: ModelConfig,
                attention_size: int, pull_id: int, block_ids: list[int]) -> Callable[[], TransferHandle]:
    """What posts rank ``rank``'s copy of its heads, blocks ``block_ids``, from rank ``holder``'s pool (the
    same heads, so the whole of each block, at the same block ids)."""
    start, stop = held_heads(model_config, rank, attention_size)

    def post() -> TransferHandle:
        metadata = transport.local_metadata() if holder == 0 else workers.transport_metadata(holder)
        workers.send_to(rank, Pull(pull_id, [(metadata, 0, 0, stop - start)], list(block_ids), list(block_ids)))
        return WorkerPart(workers, rank, pull_id)

    return post
