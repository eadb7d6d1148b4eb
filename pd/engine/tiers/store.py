"""A KV tier below host memory: the local disk, or the deployment's shared store (``pd.engine.tiers.block_store``).

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

The bytes (staging, the store's I/O, the checks) are the tier's ``records``
(``pd.engine.tiers.io.NixlRecords``), and its two threads are
``Worker``s: the simulator gives it modelled ones (``sim.tiers``), and every
decision here (index, LRU, capacity, backlog, misses) runs unchanged there.

The disk tier's index is everything in its directory: at start it finds the
records a previous run left (a warm restart). The shared store's index is
what this replica wrote or found there; beyond it, the store is asked
(``submit_query``), and a miss is believed for ``MISS_TTL_S``. Garbage collection deletes the
records this replica wrote, least recently used first, past its capacity; with a
``total_capacity_blocks`` (the shared store's whole bound) it also lists the store and deletes the
oldest records past that total, whoever wrote them (``collect_garbage``).

A failed write (a disk full, below ``min_free_bytes``, or any store error)
disables writing to the tier, with a log line and ``disabled`` set; reads of
what it holds go on. Clients never see it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Sequence

import torch

from pd.engine.clock import SYSTEM_CLOCK, Clock
from pd.engine.tiers.block_store import StoreError
from pd.engine.tiers.io import Records, ThreadWorker, Worker
from pd.engine.tiers.stats import StoreTierStats
from router.tiers import Tier

logger = logging.getLogger(__name__)

# How long a shared-store miss is believed before the store is asked again.
MISS_TTL_S = 1.0
MAX_REMEMBERED_MISSES = 4096
# The most records the writer thread stores in one transfer.
MAX_WRITE_BATCH = 32
# The most blocks one lookup asks the shared store about.
MAX_QUERY_BLOCKS = 64


class StoreTier:
    def __init__(self, tier: Tier, records: Records, capacity_blocks: int,
                 locate: Callable[[bytes], torch.Tensor | None], max_backlog: int = 4096, *,
                 total_capacity_blocks: int = 0, clock: Clock = SYSTEM_CLOCK, writer: Worker | None = None,
                 reader: Worker | None = None):
        if capacity_blocks < 1:
            raise ValueError(f"a {tier.name.lower()} tier needs room for at least one block")
        self.tier, self.records = tier, records
        self.capacity_blocks = capacity_blocks
        # The whole store's bound, whoever wrote (0: none): past it, ``collect_garbage`` deletes the oldest.
        self.total_capacity_blocks = total_capacity_blocks
        self._written_since_collect = 0
        self._collected: deque[bytes] = deque()  # deleted by the writer's collection, not yet applied
        self.locate = locate  # a block's current copy (device or host), or None once it is gone from both
        self.max_backlog = max_backlog
        self.clock = clock
        self._backlog: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # offered, waiting for staging
        self.index: OrderedDict[bytes, None] = OrderedDict()  # oldest use first
        self._mine: set[bytes] = set()  # written by this replica: only these are ever deleted
        self._misses: OrderedDict[bytes, float] = OrderedDict()  # shared store: hash -> when it was missing
        self._free_staging = list(range(records.num_staging))
        self._writing: dict[bytes, int] = {}  # hash -> staging record
        self._to_write: deque[tuple[bytes, int]] = deque()  # staged, not yet taken by the writer
        self._done: deque[tuple[bytes, int, str | None]] = deque()  # (hash, staging record, error)
        self.stats = StoreTierStats(capacity_blocks=capacity_blocks)
        self._closed = False
        if tier is Tier.DISK:
            self._warm_start()
        self._read_done: deque[tuple[str, int, list, object]] = deque()  # (kind, ticket, job, result)
        self.read_done = threading.Event()  # set as a result lands (the owner may share one among tiers)
        name = tier.name.lower()
        self._writer = writer or ThreadWorker(f"pd-{name}-writer")
        self._reader = reader or ThreadWorker(f"pd-{name}-reader")
        if total_capacity_blocks:
            self._submit_collect()  # what stopped replicas left behind

    def _warm_start(self) -> None:
        found = self.records.scan()
        surplus, kept = found[:max(0, len(found) - self.capacity_blocks)], found[-self.capacity_blocks:]
        self.records.delete(surplus)
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
        self.records.stage(record, block, block_hash, token_ids)
        self._writing[block_hash] = record
        self.stats.num_pending_writes = len(self._writing)
        self._to_write.append((block_hash, record))
        self._writer.submit(self._write_waiting, self._done.extend)

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
            self._written_since_collect += 1
            stored.append(block_hash)
        while self._collected:
            block_hash = self._collected.popleft()
            self.stats.num_collected_blocks += 1
            self._mine.discard(block_hash)
            if block_hash in self.index:
                del self.index[block_hash]
                dropped.append(block_hash)
        if self.total_capacity_blocks and self._written_since_collect >= max(1, self.total_capacity_blocks // 8):
            self._written_since_collect = 0
            self._submit_collect()
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
            self._writer.submit(lambda: self._delete(doomed), _ignore)
        self.stats.num_blocks = len(self.index)
        self.stats.num_pending_writes = len(self._writing)
        return stored, dropped

    @property
    def has_pending_writes(self) -> bool:
        return bool(self._writing or self._backlog)

    @property
    def max_read_blocks(self) -> int:
        return self.records.max_read_blocks

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
        return missed is None or self.clock.monotonic() - missed >= MISS_TTL_S

    def submit_query(self, ticket: int, block_hashes: Sequence[bytes]) -> None:
        """Ask the store, on the reader thread, which of ``block_hashes`` it holds; ``finished`` gives the run."""
        what = list(block_hashes[:MAX_QUERY_BLOCKS])
        self._reader.submit(lambda: self._query(what), lambda present: self._landed("query", ticket, what, present))

    def submit_read(self, ticket: int, items: Sequence[tuple[bytes, Sequence[int], int]]) -> None:
        """Read ``(hash, tokens, host slot)`` records into their slots on the reader thread, checking each."""
        what = list(items[:self.records.max_read_blocks])
        self._reader.submit(lambda: self._read_checked(what), lambda result: self._landed("read", ticket, what, result))

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
        self._reader.flush()

    def read_now(self, items: Sequence[tuple[bytes, Sequence[int], int]]) -> int:
        """``submit_read`` and wait for it: how many records, from the first, are good (benchmarks)."""
        self.submit_read(-1, items)
        self.wait_reads()
        return next(run for kind, ticket, run in self.finished() if ticket == -1)

    def _apply_query(self, block_hashes: list[bytes], present: list[bool]) -> int:
        self.stats.num_store_queries += 1 + (len(present) > 1)
        run, now = 0, self.clock.monotonic()
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
        self.stats.num_read_bytes += good * self.records.data_bytes
        self.stats.read_seconds += seconds
        return good

    def _landed(self, kind: str, ticket: int, what: list, result: object) -> None:
        """A query's or a read's result, from the reader: applied on the engine's thread (``finished``)."""
        self._read_done.append((kind, ticket, what, result))
        self.read_done.set()

    def _query(self, block_hashes: list[bytes]) -> list[bool]:
        """Which of ``block_hashes`` the store holds: the first alone, then, if it is there, the rest at once."""
        try:
            present = self.records.exists(block_hashes[:1])
            if present[0] and len(block_hashes) > 1:
                present += self.records.exists(block_hashes[1:])
            return present
        except (StoreError, OSError) as exc:
            logger.warning("%s tier: a query failed (%s)", self.tier.name.lower(), exc)
            return [False]

    def _read_checked(self, items: list) -> tuple[int, str | None, float]:
        """Read ``items`` into their slots: how many, from the first, are good; why the next is not; the time."""
        started = time.perf_counter()
        try:
            good, why = self.records.read(items)
        except (StoreError, OSError) as exc:
            logger.warning("%s tier: a read failed (%s); recomputing", self.tier.name.lower(), exc)
            good, why = 0, "missing"
        return good, why, time.perf_counter() - started

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write and deletion queued so far is done; ``poll`` then sees them."""
        return self._writer.flush(timeout_s)

    def close(self) -> None:
        """Finish the writes queued, then stop the writer thread; later offers are not written. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._backlog.clear()
        self._writer.close()
        self._reader.close()
        self.records.close()

    def _disable(self, error: str) -> None:
        if not self.stats.disabled:
            logger.error("%s tier: writes stopped: %s", self.tier.name.lower(), error)
        self.stats.disabled = 1
        self.stats.num_dropped_writes += len(self._backlog)
        self._backlog.clear()

    def _write_waiting(self) -> list[tuple[bytes, int, str | None]]:
        """On the writer: the records staged and not yet taken, up to ``MAX_WRITE_BATCH``, in one transfer.

        Each staging submits a call; one that finds the records taken by an
        earlier call writes nothing.
        """
        batch = []
        while self._to_write and len(batch) < MAX_WRITE_BATCH:
            batch.append(self._to_write.popleft())
        if not batch:
            return []
        error = None
        try:
            self.records.write(batch)
        except (StoreError, OSError) as exc:
            error = str(exc)
        return [(block_hash, record, error) for block_hash, record in batch]

    def collect_garbage(self) -> None:
        """Delete the store's oldest records past ``total_capacity_blocks`` now, and wait for it (a later
        ``poll`` applies it). The writer also does this every eighth of that total written."""
        self._submit_collect()
        self._writer.flush()

    def _submit_collect(self) -> None:
        self._writer.submit(self._collect, self._collected.extend)

    def _collect(self) -> list[bytes]:
        """On the writer: list the store, delete the oldest records past its total; the hashes deleted.

        Of records written in the same second (a store's resolution), others' go before this replica's own
        (those it wrote, and those it is writing: landed, not yet polled).
        """
        try:
            def own(block_hash: bytes) -> bool:
                return block_hash in self._mine or block_hash in self._writing

            listed = [block_hash for _, _, block_hash in
                      sorted((written, own(block_hash), block_hash) for written, block_hash in self.records.listing())]
            surplus = listed[:max(0, len(listed) - self.total_capacity_blocks)]
            if surplus:
                self.records.delete(surplus)
            return surplus
        except (StoreError, OSError) as exc:
            logger.warning("%s tier: collecting past the store's total failed: %s", self.tier.name.lower(), exc)
            return []

    def _delete(self, block_hashes: list[bytes]) -> None:
        try:
            self.records.delete(block_hashes)
        except (StoreError, OSError) as exc:
            logger.warning("%s tier: deleting %d records failed: %s", self.tier.name.lower(), len(block_hashes), exc)


def _ignore(result: object) -> None:
    """What a deletion delivers: nothing."""
