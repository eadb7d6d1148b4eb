"""What a lower KV tier's records are and what runs their I/O: the seam between the tiers' decisions and their bytes.

``pd.engine.tiers.store.StoreTier`` decides (index, LRU, capacity, backlog,
misses, collection); what it moves goes through ``Records`` (staging, the
store's I/O, the checks) on two ``Worker``s (a writer and a reader).
``pd.engine.tiers.tiers.build_tiers`` takes them from a ``TierIO``:

    NixlTierIO   the engine's: NixlRecords over a NixlBlockStore (NIXL POSIX or OBJ), ThreadWorkers
    sim.tiers    the simulator's: records without bytes, lanes of I/O in the event loop's time
"""

from __future__ import annotations

import errno
import queue
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from pd.config import EngineConfig
from pd.engine.tiers.block_store import NixlBlockStore, ObjectStoreConfig, check_trailer, pack_trailer
from router.tiers import Tier


class Records(Protocol):
    """A tier's bytes: ``pd.engine.tiers.io.NixlRecords``, or the simulator's modelled ones."""

    dir: Path | None  # the disk tier's directory (None for a store)
    data_bytes: int
    record_bytes: int  # data and trailer: what a record takes in the store
    num_staging: int
    max_read_blocks: int

    def stage(self, record: int, block: torch.Tensor, block_hash: bytes, token_ids: Sequence[int]) -> None: ...
    def write(self, batch: Sequence[tuple[bytes, int]]) -> None: ...
    def exists(self, block_hashes: Sequence[bytes]) -> list[bool]: ...
    def read(self, items: Sequence[tuple[bytes, Sequence[int], int]]) -> tuple[int, str | None]: ...
    def delete(self, block_hashes: Sequence[bytes]) -> None: ...
    def scan(self) -> list[bytes]: ...
    def listing(self) -> list[tuple[float, bytes]]: ...  # a store's records, any writer's: (last write, hash)
    def close(self) -> None: ...


class Worker(Protocol):
    """Runs ``work`` calls one after another, handing each result to its ``deliver``."""

    def submit(self, work: Callable[[], Any], deliver: Callable[[Any], None]) -> None: ...
    def flush(self, timeout_s: float | None = None) -> bool: ...
    def close(self) -> None: ...


class ThreadWorker:
    """A thread of its own: ``work`` and then ``deliver`` run there, in the order submitted."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], Any], deliver: Callable[[Any], None]) -> None:
        self._jobs.put((work, deliver))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted so far has run and been delivered."""
        done = threading.Event()
        self._jobs.put((None, done))
        return done.wait(timeout_s)

    def close(self) -> None:
        """Run what is queued, then stop. Idempotent."""
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, deliver = job
            if work is None:
                deliver.set()
                continue
            deliver(work())


class TierIO(Protocol):
    """What the lower tiers' records are and what runs their I/O: NIXL and threads, or the simulator's models."""

    def records(self, tier: Tier, config: EngineConfig, name: str, namespace: str, block_bytes: int,
                host_cache: torch.Tensor) -> Records: ...
    def worker(self, tier: Tier, role: str) -> Worker: ...
    def event(self) -> threading.Event: ...


class NixlTierIO:
    """The engine's own: block files through NIXL's POSIX backend, objects through its OBJ backend, on threads."""

    def records(self, tier: Tier, config: EngineConfig, name: str, namespace: str, block_bytes: int,
                host_cache: torch.Tensor) -> Records:
        if tier is Tier.DISK:
            store = NixlBlockStore(f"{name}-disk", namespace, config.block_size, block_bytes,
                                   path=config.disk_kv_cache_path)
            return NixlRecords(store, host_cache, num_staging=config.kv_tier_write_slots,
                               min_free_bytes=config.disk_kv_min_free_bytes)
        bucket = ObjectStoreConfig(config.shared_kv_bucket, config.shared_kv_endpoint)
        store = NixlBlockStore(f"{name}-shared", namespace, config.block_size, block_bytes, bucket=bucket)
        return NixlRecords(store, host_cache, num_staging=config.kv_tier_write_slots)

    def worker(self, tier: Tier, role: str) -> Worker:
        return ThreadWorker(f"pd-{tier.name.lower()}-{role}")

    def event(self) -> threading.Event:
        return threading.Event()


class NixlRecords:
    """The bytes of a ``StoreTier`` over a ``NixlBlockStore``: its staging records, reads into host slots, checks.

    ``stage`` copies a block and its trailer into a staging record (on the
    engine's thread); ``write``, ``read``, ``exists`` and ``delete`` run on
    the tier's workers. A read lands in host-tier slots and is checked
    against the hash and tokens asked for (``check_trailer``).
    """

    def __init__(self, store: NixlBlockStore, host_cache, *, num_staging: int, max_read_blocks: int = 256,
                 min_free_bytes: int = 0):
        import torch  # here: the module itself needs only numpy

        self.store = store
        self.host_cache = host_cache  # [host slots, *block]: reads land here
        self.min_free_bytes = min_free_bytes
        self.data_bytes, self.record_bytes = store.data_bytes, store.record_bytes
        self._staging = torch.zeros(num_staging, store.record_bytes, dtype=torch.uint8)
        self._trailers = torch.zeros(max_read_blocks, store.trailer_bytes, dtype=torch.uint8)
        for tensor in (self._staging, self._trailers, host_cache):
            store.register(tensor)

    @property
    def dir(self) -> Path | None:
        return self.store.dir

    @property
    def num_staging(self) -> int:
        return len(self._staging)

    @property
    def max_read_blocks(self) -> int:
        return len(self._trailers)

    def stage(self, record: int, block, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Copy ``block`` and its trailer into staging record ``record``."""
        staging = self._staging[record]
        staging[:self.data_bytes].view(block.dtype).view(block.shape).copy_(block)
        pack_trailer(staging[self.data_bytes:].numpy(), block_hash, token_ids, self.data_bytes, self.store.namespace)

    def write(self, batch: Sequence[tuple[bytes, int]]) -> None:
        """Store the staged ``(hash, record)`` records, in one transfer; raises ``StoreError`` or ``OSError``."""
        self._check_free_space(len(batch))
        self.store.write([(block_hash, self._staging[record].data_ptr()) for block_hash, record in batch])

    def exists(self, block_hashes: Sequence[bytes]) -> list[bool]:
        return self.store.exists(block_hashes)

    def read(self, items: Sequence[tuple[bytes, Sequence[int], int]]) -> tuple[int, str | None]:
        """Read ``(hash, tokens, host slot)`` records into their slots: how many, from the first, are good;
        why the next one is not."""
        host, host_row = self.host_cache.data_ptr(), self.host_cache[0].nbytes
        trailer, trailer_row = self._trailers.data_ptr(), self.store.trailer_bytes
        ok = self.store.read([(block_hash, host + slot * host_row, trailer + index * trailer_row)
                              for index, (block_hash, _, slot) in enumerate(items)])
        trailers = self._trailers.numpy()
        for index, (block_hash, token_ids, _) in enumerate(items):
            why = check_trailer(trailers[index].tobytes(), block_hash, token_ids, self.data_bytes,
                                self.store.namespace) if ok[index] else "missing"
            if why is not None:
                return index, why
        return len(items), None

    def delete(self, block_hashes: Sequence[bytes]) -> None:
        self.store.delete(block_hashes)

    def scan(self) -> list[bytes]:
        return self.store.scan()

    def listing(self) -> list[tuple[float, bytes]]:
        return self.store.listing()

    def close(self) -> None:
        self.store.close()

    def _check_free_space(self, num_records: int) -> None:
        if self.store.dir is None or not self.min_free_bytes:
            return
        free = shutil.disk_usage(self.store.dir).free
        if free - num_records * self.record_bytes < self.min_free_bytes:
            raise OSError(errno.ENOSPC, f"{free} bytes free on {self.store.dir}, below the "
                                        f"{self.min_free_bytes} kept free")
