"""A KV tier below host memory: the local disk, or the deployment's shared store (``pd.engine.block_store``).

Blocks are written through: when a block is computed and cached, the tier
copies it into one of ``num_staging`` staging records, and its writer thread
stores it. A step never waits for a write. The staging records bound the
bandwidth a tier takes: when every one is in flight, the block waits in a
backlog (oldest first, at most ``max_backlog``), and a later ``poll`` stages
it from wherever it is then, device or host; one gone from both by then is
not written (counted in ``num_dropped_writes``).

    cached block --offer--> [backlog] --> staging record --writer thread--> file / object
                                                   |
    poll() (between steps) <-- done ---------------+   index (LRU) updated, over-capacity records deleted

Reads and the shared store's queries run on a reader thread
(``submit_read``, ``submit_query``), straight into host-tier slots; what
they found is applied on the engine's thread (``finished``). Each record read
back is checked against the hash and tokens asked for.

The disk tier's index is everything in its directory: at start it finds the
records a previous run left (a warm restart). The shared store's index is
what this replica wrote or found there; beyond it, the store is asked
(``submit_query``), and a miss is believed for ``MISS_TTL_S``. Garbage collection deletes only
records this replica wrote, least recently used first, past the capacity.

A failed write (a disk full, below ``min_free_bytes``, or any store error)
disables writing to the tier, with a log line and ``disabled`` set; reads of
what it holds go on. Clients never see it.
"""

from __future__ import annotations

import errno
import logging
import queue
import shutil
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pd.engine.block_pool import Tier
from pd.engine.block_store import NixlBlockStore, StoreError, check_trailer, pack_trailer

logger = logging.getLogger(__name__)

# How long a shared-store miss is believed before the store is asked again.
MISS_TTL_S = 1.0
MAX_REMEMBERED_MISSES = 4096
# The most records the writer thread stores in one transfer.
MAX_WRITE_BATCH = 32
# The most blocks one lookup asks the shared store about.
MAX_QUERY_BLOCKS = 64


@dataclass
class StoreTierStats:
    num_written_blocks: int = 0
    num_dropped_writes: int = 0  # not written: gone from device and host, or past the backlog, before a write
    num_pending_writes: int = 0  # in flight now
    num_read_blocks: int = 0
    num_read_bytes: int = 0
    read_seconds: float = 0.0
    num_rejected_reads: int = 0  # missing, short or not the block asked for: recomputed
    num_store_queries: int = 0  # shared store: questions of which blocks it holds
    num_deleted_blocks: int = 0
    num_blocks: int = 0  # indexed now
    capacity_blocks: int = 0
    disabled: int = 0  # 1 once a write failed (a disk full): no more writes


class StoreTier:
    def __init__(self, tier: Tier, store: NixlBlockStore, capacity_blocks: int, host_cache: torch.Tensor,
                 locate: Callable[[bytes], torch.Tensor | None], num_staging: int = 32, min_free_bytes: int = 0,
                 max_read_blocks: int = 256, max_backlog: int = 4096):
        if capacity_blocks < 1:
            raise ValueError(f"a {tier.name.lower()} tier needs room for at least one block")
        self.tier, self.store = tier, store
        self.capacity_blocks = capacity_blocks
        self.locate = locate  # a block's current copy (device or host), or None once it is gone from both
        self.max_backlog = max_backlog
        self._backlog: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # offered, waiting for staging
        self.min_free_bytes = min_free_bytes
        self.host_cache = host_cache  # [host slots, *block]: reads land here
        self.index: OrderedDict[bytes, None] = OrderedDict()  # oldest use first
        self._mine: set[bytes] = set()  # written by this replica: only these are ever deleted
        self._misses: OrderedDict[bytes, float] = OrderedDict()  # shared store: hash -> when it was missing
        self._staging = torch.zeros(num_staging, store.record_bytes, dtype=torch.uint8)
        self._trailers = torch.zeros(max_read_blocks, store.trailer_bytes, dtype=torch.uint8)
        for tensor in (self._staging, self._trailers, host_cache):
            store.register(tensor)
        self._free_staging = list(range(num_staging))
        self._writing: dict[bytes, int] = {}  # hash -> staging record
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[tuple[bytes, int, str | None]] = deque()  # (hash, staging record, error)
        self.stats = StoreTierStats(capacity_blocks=capacity_blocks)
        self._closed = False
        if store.dir is not None:
            self._warm_start()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._read_done: deque[tuple[str, int, list, object]] = deque()  # (kind, ticket, job, result)
        self.read_done = threading.Event()  # set as a result lands (the owner may share one among tiers)
        self._writer = threading.Thread(target=self._write_loop, name=f"pd-{tier.name.lower()}-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"pd-{tier.name.lower()}-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def _warm_start(self) -> None:
        found = self.store.scan()
        surplus, kept = found[:max(0, len(found) - self.capacity_blocks)], found[-self.capacity_blocks:]
        self.store.delete(surplus)
        self.index.update((block_hash, None) for block_hash in kept)
        self._mine.update(kept)
        self.stats.num_blocks = len(self.index)
        if kept:
            logger.info("%s tier: %d blocks found from an earlier run", self.tier.name.lower(), len(kept))

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def offer(self, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Write a computed block through to the tier, unless it is there or on its way.

        With no staging record free it waits in the backlog, and is staged
        by a later ``poll`` if ``locate`` still finds it then.
        """
        if self._closed or self.stats.disabled or block_hash in self.index or block_hash in self._writing:
            return
        if self._free_staging and not self._backlog:
            self._stage(block_hash, token_ids)
            return
        self._backlog[block_hash] = tuple(token_ids)
        if len(self._backlog) > self.max_backlog:
            self._backlog.popitem(last=False)
            self.stats.num_dropped_writes += 1

    def _stage(self, block_hash: bytes, token_ids: Sequence[int]) -> None:
        block = self.locate(block_hash)
        if block is None:  # gone from device and host before a staging record was free
            self.stats.num_dropped_writes += 1
            return
        record = self._free_staging.pop()
        staging = self._staging[record]
        data_bytes = self.store.data_bytes
        staging[:data_bytes].view(block.dtype).view(block.shape).copy_(block)
        pack_trailer(staging[data_bytes:].numpy(), block_hash, token_ids, data_bytes)
        self._writing[block_hash] = record
        self.stats.num_pending_writes = len(self._writing)
        self._jobs.put(("write", block_hash, record))

    def poll(self) -> tuple[list[bytes], list[bytes]]:
        """Finish the writes done since the last poll and collect garbage; ``(stored, dropped)`` hashes."""
        stored, dropped = [], []
        while self._done:
            block_hash, record, error = self._done.popleft()
            del self._writing[block_hash]
            self._free_staging.append(record)
            if error is not None:
                self._disable(error)
                continue
            self.index[block_hash] = None
            self._mine.add(block_hash)
            self._misses.pop(block_hash, None)
            self.stats.num_written_blocks += 1
            stored.append(block_hash)
        while self._backlog and self._free_staging and not self._closed and not self.stats.disabled:
            block_hash, token_ids = self._backlog.popitem(last=False)
            if block_hash not in self.index and block_hash not in self._writing:
                self._stage(block_hash, token_ids)
        doomed = []
        while len(self.index) > self.capacity_blocks:
            block_hash, _ = self.index.popitem(last=False)
            dropped.append(block_hash)
            if block_hash in self._mine:
                self._mine.discard(block_hash)
                doomed.append(block_hash)
        if doomed:
            self.stats.num_deleted_blocks += len(doomed)
            self._jobs.put(("delete", doomed, None))
        self.stats.num_blocks = len(self.index)
        self.stats.num_pending_writes = len(self._writing)
        return stored, dropped

    @property
    def has_pending_writes(self) -> bool:
        return bool(self._writing or self._backlog)

    @property
    def max_read_blocks(self) -> int:
        return len(self._trailers)

    def local_run(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes``, from the first, the tier's index holds (no store is asked)."""
        run = 0
        for block_hash in block_hashes:
            if block_hash not in self.index:
                break
            run += 1
        return run

    def worth_asking(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether the shared store should be asked for this run: not indexed, and not missed lately."""
        if self.tier is not Tier.SHARED or not block_hashes or block_hashes[0] in self.index:
            return False
        missed = self._misses.get(block_hashes[0])
        return missed is None or time.monotonic() - missed >= MISS_TTL_S

    def submit_query(self, ticket: int, block_hashes: Sequence[bytes]) -> None:
        """Ask the store, on the reader thread, which of ``block_hashes`` it holds; ``finished`` gives the run."""
        self._reads.put(("query", ticket, list(block_hashes[:MAX_QUERY_BLOCKS])))

    def submit_read(self, ticket: int, items: Sequence[tuple[bytes, Sequence[int], int]]) -> None:
        """Read ``(hash, tokens, host slot)`` records into their slots on the reader thread, checking each."""
        self._reads.put(("read", ticket, list(items[:len(self._trailers)])))

    def finished(self) -> list[tuple[str, int, int]]:
        """``(kind, ticket, run)`` of the queries and reads done since the last call.

        A query's run: how many of its hashes the store holds, from the first.
        A read's run: how many of its records, from the first, were read and
        good. A record that is missing, short or not the block asked for ends
        the run there and leaves the index: that part of a prompt is recomputed.
        """
        done = []
        while self._read_done:
            kind, ticket, what, result = self._read_done.popleft()
            run = self._apply_query(what, result) if kind == "query" else self._apply_read(what, *result)
            done.append((kind, ticket, run))
        return done

    @property
    def has_finished_reads(self) -> bool:
        return bool(self._read_done)

    def wait_reads(self) -> None:
        """Wait until the queries and reads submitted so far are done (``finished`` then has them)."""
        done = threading.Event()
        self._reads.put(("flush", -1, done))
        done.wait()

    def read_now(self, items: Sequence[tuple[bytes, Sequence[int], int]]) -> int:
        """``submit_read`` and wait for it: how many records, from the first, are good (benchmarks)."""
        self.submit_read(-1, items)
        self.wait_reads()
        return next(run for kind, ticket, run in self.finished() if ticket == -1)

    def _apply_query(self, block_hashes: list[bytes], present: list[bool]) -> int:
        self.stats.num_store_queries += 1 + (len(present) > 1)
        run, now = 0, time.monotonic()
        for block_hash, held in zip(block_hashes, present):
            if not held:
                self._misses[block_hash] = now
                self._misses.move_to_end(block_hash)
                if len(self._misses) > MAX_REMEMBERED_MISSES:
                    self._misses.popitem(last=False)
                break
            self.index[block_hash] = None
            run += 1
        return run

    def _apply_read(self, items: list, good: int, why: str | None, seconds: float) -> int:
        for block_hash, _, _ in items[:good]:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
        if why is not None:
            block_hash = items[good][0]
            logger.warning("%s tier: block %s rejected (%s); recomputing", self.tier.name.lower(),
                           block_hash.hex(), why)
            self.stats.num_rejected_reads += 1
            self.index.pop(block_hash, None)
        self.stats.num_read_blocks += good
        self.stats.num_read_bytes += good * self.store.data_bytes
        self.stats.read_seconds += seconds
        return good

    def _read_loop(self) -> None:
        """The reader thread: store I/O only; what it finds is applied on the engine's thread (``finished``)."""
        while (job := self._reads.get()) is not None:
            kind, ticket, what = job
            if kind == "flush":
                what.set()
                continue
            result = self._query(what) if kind == "query" else self._read_checked(what)
            self._read_done.append((kind, ticket, what, result))
            self.read_done.set()

    def _query(self, block_hashes: list[bytes]) -> list[bool]:
        """Which of ``block_hashes`` the store holds: the first alone, then, if it is there, the rest at once."""
        try:
            present = self.store.exists(block_hashes[:1])
            if present[0] and len(block_hashes) > 1:
                present += self.store.exists(block_hashes[1:])
            return present
        except (StoreError, OSError) as exc:
            logger.warning("%s tier: a query failed (%s)", self.tier.name.lower(), exc)
            return [False]

    def _read_checked(self, items: list) -> tuple[int, str | None, float]:
        """Read ``items`` into their slots: how many, from the first, are good; why the next is not; the time."""
        started = time.perf_counter()
        host, host_row = self.host_cache.data_ptr(), self.host_cache[0].nbytes
        trailer, trailer_row = self._trailers.data_ptr(), self.store.trailer_bytes
        reads = [(block_hash, host + slot * host_row, trailer + index * trailer_row)
                 for index, (block_hash, _, slot) in enumerate(items)]
        try:
            ok = self.store.read(reads)
        except (StoreError, OSError) as exc:
            logger.warning("%s tier: a read failed (%s); recomputing", self.tier.name.lower(), exc)
            ok = [False] * len(items)
        trailers = self._trailers.numpy()
        for index, (block_hash, token_ids, _) in enumerate(items):
            why = check_trailer(trailers[index].tobytes(), block_hash, token_ids,
                                self.store.data_bytes) if ok[index] else "missing"
            if why is not None:
                return index, why, time.perf_counter() - started
        return len(items), None, time.perf_counter() - started

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write and deletion queued so far is done; ``poll`` then sees them."""
        done = threading.Event()
        self._jobs.put(("flush", done, None))
        return done.wait(timeout_s)

    def close(self) -> None:
        """Finish the writes queued, then stop the writer thread; later offers are not written. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._backlog.clear()
        self._jobs.put(None)
        self._reads.put(None)
        self._writer.join()
        self._reader.join()
        self.store.close()

    def _disable(self, error: str) -> None:
        if not self.stats.disabled:
            logger.error("%s tier: writes stopped: %s", self.tier.name.lower(), error)
        self.stats.disabled = 1
        self.stats.num_dropped_writes += len(self._backlog)
        self._backlog.clear()

    def _write_loop(self) -> None:
        """The writer thread: writes waiting one after another are stored together, in one transfer."""
        held: deque = deque()  # the job that ended a batch, next in line
        while (job := held.popleft() if held else self._jobs.get()) is not None:
            kind, what, record = job
            if kind == "flush":
                what.set()
            elif kind == "delete":
                try:
                    self.store.delete(what)
                except (StoreError, OSError) as exc:
                    logger.warning("%s tier: deleting %d records failed: %s", self.tier.name.lower(), len(what), exc)
            else:
                batch = [(what, record)]
                while len(batch) < MAX_WRITE_BATCH and not self._jobs.empty():
                    job = self._jobs.get()
                    if job is None or job[0] != "write":
                        held.append(job)
                        break
                    batch.append(job[1:])
                self._write(batch)

    def _write(self, batch: list[tuple[bytes, int]]) -> None:
        error = None
        try:
            self._check_free_space(len(batch))
            self.store.write([(block_hash, self._staging[record].data_ptr()) for block_hash, record in batch])
        except (StoreError, OSError) as exc:
            error = str(exc)
        self._done.extend((block_hash, record, error) for block_hash, record in batch)

    def _check_free_space(self, num_records: int) -> None:
        if self.store.dir is None or not self.min_free_bytes:
            return
        free = shutil.disk_usage(self.store.dir).free
        if free - num_records * self.store.record_bytes < self.min_free_bytes:
            raise OSError(errno.ENOSPC, f"{free} bytes free on {self.store.dir}, below the "
                                        f"{self.min_free_bytes} kept free")
