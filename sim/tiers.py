"""The disk tier and the shared store in simulated time: records without bytes, I/O that takes modelled time.

The engine's own tiers run unchanged (``pd.engine.tiers.store``: the index,
LRU, capacity, write backlog, staging bound and remembered misses;
``pd.engine.tiers.loads``; the host tier), through the seam
``pd.engine.tiers.io.TierIO``. Only what moves bytes is modelled:

    records  which block hashes a store holds: a replica's disk, or the
             deployment's shared store (one ``ModelledStore`` for every replica)
    workers  one lane per tier and direction, as the engine's writer and reader
             threads: a call starts when its lane is free, and its result lands
             ``op_s + bytes / bytes_per_s`` later (``StoreModel``), waking the replica

A write becomes visible to other replicas when it lands, not when it starts.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from pd.config import EngineConfig
from pd.engine.tiers.block_store import trailer_bytes
from router.tiers import Tier
from sim.clock import EventLoop


@dataclass(frozen=True)
class StoreModel:
    """The time of one transfer to or from a store: a fixed cost per call, plus its bytes over a bandwidth."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    op_s: float  # per call: a batch of records written or read, a query, a deletion
    source: str

    def __post_init__(self) -> None:
        if self.read_bytes_per_s <= 0 or self.write_bytes_per_s <= 0 or self.op_s < 0:
            raise ValueError(f"a store model needs bandwidths > 0 and op_s >= 0, got {self}")

    def seconds(self, num_bytes: int, write: bool) -> float:
        return self.op_s + num_bytes / (self.write_bytes_per_s if write else self.read_bytes_per_s)


# Analytic presets, stated as such: a data-centre NVMe drive's sequential rates, and an S3-compatible store
# reached over the network (first byte in about 10 ms, one stream's throughput).
LOCAL_NVME = StoreModel(read_bytes_per_s=3e9, write_bytes_per_s=2e9, op_s=100e-6,
                        source="analytic: a local NVMe drive, 3 GB/s read, 2 GB/s write, 100 us per call")
OBJECT_STORE = StoreModel(read_bytes_per_s=1e9, write_bytes_per_s=0.5e9, op_s=10e-3,
                          source="analytic: an S3-compatible store, 1 GB/s read, 0.5 GB/s write, 10 ms per call")


@dataclass(frozen=True)
class TierModels:
    disk: StoreModel = LOCAL_NVME
    shared: StoreModel = OBJECT_STORE


class ModelledStore:
    """The block hashes a store holds (no bytes): a replica's disk, or a deployment's shared store."""

    def __init__(self) -> None:
        self.hashes: OrderedDict[bytes, None] = OrderedDict()  # oldest write first

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes

    def __len__(self) -> int:
        return len(self.hashes)


class ModelledRecords:
    """``pd.engine.tiers.io.Records`` over a ``ModelledStore``: each call adds the time it would take.

    A read finds the run of records the store holds, from the first; a
    record it lacks ends the run, as a missing file does. Writes and
    deletions change the store when their call lands (``take``).
    """

    dir = None

    def __init__(self, store: ModelledStore, model: StoreModel, data_bytes: int, record_bytes: int,
                 num_staging: int, max_read_blocks: int = 256):
        self.store, self.model = store, model
        self.data_bytes, self.record_bytes = data_bytes, record_bytes
        self.num_staging, self.max_read_blocks = num_staging, max_read_blocks
        self._owed_s = 0.0
        self._effects: list[Callable[[], None]] = []

    def stage(self, record: int, block: torch.Tensor, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Nothing to copy: the block has no bytes here."""

    def write(self, batch: Sequence[tuple[bytes, int]]) -> None:
        hashes = [block_hash for block_hash, _ in batch]
        self._owed_s += self.model.seconds(len(batch) * self.record_bytes, write=True)
        self._effects.append(lambda: self.store.hashes.update((h, None) for h in hashes))

    def exists(self, block_hashes: Sequence[bytes]) -> list[bool]:
        self._owed_s += self.model.op_s
        return [block_hash in self.store for block_hash in block_hashes]

    def read(self, items: Sequence[tuple[bytes, Sequence[int], int]]) -> tuple[int, str | None]:
        good = next((index for index, (block_hash, _, _) in enumerate(items) if block_hash not in self.store),
                    len(items))
        self._owed_s += self.model.seconds(good * self.record_bytes, write=False)
        return good, None if good == len(items) else "missing"

    def delete(self, block_hashes: Sequence[bytes]) -> None:
        hashes = list(block_hashes)
        self._owed_s += self.model.op_s
        self._effects.append(lambda: [self.store.hashes.pop(h, None) for h in hashes])

    def scan(self) -> list[bytes]:
        return list(self.store.hashes)

    def listing(self) -> list[tuple[float, bytes]]:
        self._owed_s += self.model.op_s
        return [(float(order), block_hash) for order, block_hash in enumerate(self.store.hashes)]

    def close(self) -> None:
        """Nothing is open."""

    def take(self) -> tuple[float, list[Callable[[], None]]]:
        """The seconds and the store changes of the calls made since the last ``take``."""
        owed, effects = self._owed_s, self._effects
        self._owed_s, self._effects = 0.0, []
        return owed, effects


class LoopWorker:
    """A ``pd.engine.tiers.io.Worker`` in simulated time: one call at a time; each lands after its modelled time."""

    def __init__(self, loop: EventLoop, records: ModelledRecords, on_event: Callable[[], None]):
        self.loop, self.records, self.on_event = loop, records, on_event
        self._queue: deque[tuple[Callable[[], Any], Callable[[Any], None]]] = deque()
        self._busy = False

    def submit(self, work: Callable[[], Any], deliver: Callable[[Any], None]) -> None:
        self._queue.append((work, deliver))
        if not self._busy:
            self._start_next()

    def _start_next(self) -> None:
        if not self._queue:
            self._busy = False
            return
        self._busy = True
        work, deliver = self._queue.popleft()
        result = work()  # what it reads is the store as the call starts
        seconds, effects = self.records.take()

        def land() -> None:
            for effect in effects:
                effect()
            deliver(result)
            self._start_next()
            self.on_event()

        self.loop.at(self.loop.now + seconds, land)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Simulated I/O lands as the event loop runs: nothing can be waited for here."""
        raise RuntimeError("a simulated tier's I/O lands as the event loop runs; run the loop instead of waiting")

    def close(self) -> None:
        """What is queued is dropped with the simulation."""


class _NeverBlocks:
    """The tiers' "a load finished" event, for an engine in simulated time: a wait returns at once."""

    def set(self) -> None:
        """Results land from the event loop, which wakes the replica itself."""

    def clear(self) -> None:
        """Nothing is kept."""

    def wait(self, timeout: float | None = None) -> bool:
        return False


class ModelledTierIO:
    """``pd.engine.tiers.io.TierIO`` for one simulated replica: its own disk, and the deployment's shared store.

    ``on_event`` is called as each call lands (the replica's ``wake``).
    """

    def __init__(self, loop: EventLoop, models: TierModels = TierModels(), shared: ModelledStore | None = None):
        self.loop, self.models = loop, models
        self.disk = ModelledStore()
        self.shared = shared if shared is not None else ModelledStore()
        self.on_event: Callable[[], None] = lambda: None
        self._records: dict[Tier, ModelledRecords] = {}

    def records(self, tier: Tier, config: EngineConfig, name: str, namespace: str, block_bytes: int,
                host_cache: torch.Tensor) -> ModelledRecords:
        store, model = (self.disk, self.models.disk) if tier is Tier.DISK else (self.shared, self.models.shared)
        records = ModelledRecords(store, model, block_bytes, block_bytes + trailer_bytes(config.block_size),
                                  config.kv_tier_write_slots)
        self._records[tier] = records
        return records

    def worker(self, tier: Tier, role: str) -> LoopWorker:
        return LoopWorker(self.loop, self._records[tier], lambda: self.on_event())

    def event(self) -> _NeverBlocks:
        return _NeverBlocks()
