"""The KV tiers behind the device pool: host memory, the local disk and the shared store, as one prefix cache.

    device pool --evict--> host tier (demote)          cached block --write through--> disk, shared store
    lookup: device run, then host run, then disk run, then shared-store run; all promoted to device blocks

A request whose prompt continues below the host tier waits, off the step,
while the disk's and the shared store's records are read into host slots and
checked (``begin``, ``pd.engine.tiers.loads``). Its prefix match (``promote``)
then finds the longest chain in device and host memory and copies what it
found in host memory into free device blocks, cached there, so the scheduler
sees device hits. A record that fails its check ends the chain: the rest is
recomputed.

The replica's cache events (``router.events.CacheEvent``) say where
it holds each block: the fastest tier holding it, or nowhere. Blocks in the
shared store are announced apart (``Tier.SHARED``): every replica can read them.
A disk tier that finds blocks from an earlier run announces them at start.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from pd.config import EngineConfig
from pd.engine.block_pool import BlockPool, Evictions
from pd.engine.clock import SYSTEM_CLOCK, Clock
from pd.engine.kv_cache_manager import update_block_hashes
from pd.engine.request import Request
from pd.engine.tiers.base import NO_TIERS, Tiers
from pd.engine.tiers.block_store import namespace_of
from pd.engine.tiers.host import HostTier
from pd.engine.tiers.io import NixlTierIO, TierIO
from pd.engine.tiers.loads import TierLoads
from pd.engine.tiers.stats import HostTierStats, StoreTierStats, tier_counters
from pd.engine.tiers.store import StoreTier
from router.tiers import Tier


class KVTiers:
    """The ``Tiers`` of an engine with a host tier, and a disk tier and a shared store if configured.

    ``evictions`` is the pool's (``BlockPool(evictions=...)``): its evicted cached blocks are demoted to a
    host tier of ``num_host_blocks`` blocks of ``device_cache``'s shape.
    """

    def __init__(self, pool: BlockPool, evictions: Evictions, device_cache: torch.Tensor, num_host_blocks: int,
                 block_size: int, loaded: threading.Event | None = None):
        host = HostTier(device_cache, num_host_blocks, on_drop=self._on_host_drop)
        self.pool, self.host, self.block_size = pool, host, block_size
        self.disk: StoreTier | None = None
        self.shared: StoreTier | None = None
        self.lower: list[StoreTier] = []  # disk, then the shared store: those configured
        self.loads = TierLoads(pool, host, self.lower, block_size)
        self._loaded = loaded or threading.Event()  # a lower tier's query or read finished
        evictions.bind(self._on_device_evict)

    def attach(self, disk: StoreTier | None, shared: StoreTier | None) -> "KVTiers":
        """Put the disk tier and the shared store under the host tier (either may be None)."""
        self.disk, self.shared = disk, shared
        self.lower[:] = [tier for tier in (disk, shared) if tier is not None]
        for tier in self.lower:
            tier.read_done = self._loaded
        if disk is not None:
            for block_hash in disk.index:  # found from an earlier run
                self.pool.events.record(block_hash, stored=True, tier=Tier.DISK)
        return self

    def where(self, block_hash: bytes) -> Tier | None:
        """The fastest tier of this replica holding ``block_hash`` (the shared store aside)."""
        if self.pool.is_cached(block_hash):
            return Tier.DEVICE
        if block_hash in self.host:
            return Tier.HOST
        if self.disk is not None and block_hash in self.disk:
            return Tier.DISK
        return None

    def on_cached(self, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """A block was computed and cached: write it through to the lower tiers."""
        for tier in self.lower:
            tier.offer(block_hash, token_ids)

    def locate(self, block_hash: bytes) -> torch.Tensor | None:
        """The current copy of a block: its device block, else its host slot; None once gone from both."""
        block_id = self.pool.block_of(block_hash)
        if block_id is not None:
            return self.host.device_cache[block_id]
        slot = self.host.slot_of(block_hash)
        if slot is None:
            return None
        self.host.settle()  # the caller reads the slot on the host: its demotion's copy has landed
        return self.host.cache[slot]

    def _on_device_evict(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> Tier | None:
        if self.host.demote(block_id, block_hash, token_ids) is Tier.HOST:
            return Tier.HOST
        return self.where(block_hash)

    def _on_host_drop(self, block_hash: bytes) -> None:
        if self.pool.is_cached(block_hash):
            return  # the device copy is the faster one: nothing changes for routers
        lower = self.where(block_hash)
        self.pool.events.record(block_hash, stored=lower is not None, tier=lower or Tier.DEVICE)

    def poll(self) -> list[Request]:
        """Between steps: apply the loads' and writes' results, collect garbage, announce what changed.

        Returns the requests whose loads are done (``begin``), for the scheduler.
        """
        for tier in self.lower:
            for kind, ticket, run in tier.finished():
                self.loads.finish(tier, kind, ticket, run)
            self._announce(tier, *tier.poll())
        return self.loads.take_ready()

    def wait_for_loads(self, timeout_s: float) -> None:
        """With nothing else to run: block (the GIL released) until a load's result lands, or ``timeout_s``."""
        self._loaded.clear()
        if self.loads.num_waiting and not any(tier.has_finished_reads for tier in self.lower):
            self._loaded.wait(timeout_s)

    def begin(self, request: Request) -> bool:
        """Whether ``request`` waits for blocks loaded from the disk or the shared store (``TierLoads.begin``)."""
        update_block_hashes(request, self.block_size)
        return bool(self.lower) and self.loads.begin(request)

    @property
    def host_stats(self) -> HostTierStats:
        return self.host.stats

    @property
    def num_waiting(self) -> int:
        return self.loads.num_waiting

    def cancel(self, request_id: str) -> bool:
        return self.loads.cancel(request_id)

    def release(self, request_id: str) -> None:
        self.loads.release(request_id)

    def before_run(self, remote_writes: bool) -> None:
        """The blocks just reused hold demoted KV until its copies are issued (``HostTier.flush``); pulls
        write into them outside any device stream's order, so with ``remote_writes`` the copies must have
        landed (``settle``)."""
        if remote_writes:
            self.host.settle()
        else:
            self.host.flush()

    def counters(self) -> dict[str, int | float]:
        """The tiers' counters under ``EngineStats`` names (zeros for a lower tier not configured)."""
        return tier_counters(self.host.stats, *(tier.stats if tier is not None else StoreTierStats()
                                                for tier in (self.disk, self.shared)))

    def _announce(self, tier: StoreTier, stored: list[bytes], dropped: list[bytes]) -> None:
        """Cache events for what a lower tier's writes and garbage collection changed."""
        if tier.tier is Tier.SHARED:
            for block_hash in stored:
                self.pool.events.record(block_hash, stored=True, tier=Tier.SHARED)
            for block_hash in dropped:
                self.pool.events.record(block_hash, stored=False, tier=Tier.SHARED)
            return
        for block_hash in stored:
            if self.where(block_hash) is Tier.DISK:
                self.pool.events.record(block_hash, stored=True, tier=Tier.DISK)
        for block_hash in dropped:
            if self.where(block_hash) is None:
                self.pool.events.record(block_hash, stored=False)

    def promote(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
                device_ids: list[int]) -> bool:
        """Copy the host tier's run of ``block_hashes`` after ``device_ids`` into free device blocks.

        They are cached there, unreferenced like any cached block, until the
        request is admitted. The device run found so far is held meanwhile,
        so the allocation (which evicts, and so demotes, other cached blocks)
        cannot take it. Never uses more than the free blocks.
        """
        start = len(device_ids)
        free_hits = sum(1 for block_id in device_ids if self.pool.is_free(block_id))
        room = max(0, self.pool.num_free_blocks - free_hits)
        found = self.host.match(block_hashes[start:start + room], token_ids, block_size, start)[:room]
        if not found:
            return False
        self.host.reserve(found)
        self.pool.touch(device_ids)
        new_ids = self.pool.allocate(len(found))
        for block_id, block_hash, tokens in zip(new_ids, found, self.host.promote(found, new_ids)):
            self.pool.insert(block_id, block_hash, tokens)
        self.pool.free(reversed(new_ids))
        self.pool.free(reversed(device_ids))
        return True

    @property
    def has_pending_writes(self) -> bool:
        """Writes in flight to a lower tier: ``poll`` must run to finish them, even with nothing to step."""
        return any(tier.has_pending_writes for tier in self.lower)

    @property
    def has_pending_work(self) -> bool:
        """Loads or writes in flight: ``poll`` must run even with nothing to step."""
        return self.loads.num_waiting > 0 or self.has_pending_writes

    def flush(self) -> None:
        """Wait until the lower tiers have written everything offered so far (``poll`` included)."""
        while True:
            for tier in self.lower:
                tier.flush()
            self.poll()
            if not self.has_pending_writes:
                return

    def close(self) -> None:
        for tier in self.lower:
            tier.close()


def build_tiers(config: EngineConfig, pool: BlockPool, evictions: Evictions, device_cache: torch.Tensor,
                block_bytes: int, fingerprint: bytes, name: str, *, clock: Clock = SYSTEM_CLOCK,
                io: TierIO | None = None) -> Tiers:
    """The tiers ``config`` asks for, under ``pool`` (whose ``evictions`` they bind); ``NO_TIERS`` without a
    host tier.

    ``io`` says what the disk tier's and the shared store's records are and
    what runs their I/O (``NixlTierIO`` unless given: the simulator's seam).
    """
    if not config.host_kv_cache_bytes:
        return NO_TIERS
    if config.host_kv_cache_bytes < block_bytes:
        raise ValueError(f"host_kv_cache_bytes {config.host_kv_cache_bytes} holds no block of {block_bytes} bytes")
    io = io or NixlTierIO()
    tiers = KVTiers(pool, evictions, device_cache, config.host_kv_cache_bytes // block_bytes, config.block_size,
                    io.event())
    namespace = namespace_of(fingerprint)

    def lower(tier: Tier, capacity_bytes: int, total_bytes: int = 0) -> StoreTier:
        records = io.records(tier, config, name, namespace, block_bytes, tiers.host.cache)
        return StoreTier(tier, records, max(1, capacity_bytes // records.record_bytes), tiers.locate,
                         total_capacity_blocks=total_bytes // records.record_bytes, clock=clock,
                         writer=io.worker(tier, "writer"), reader=io.worker(tier, "reader"))

    disk = lower(Tier.DISK, config.disk_kv_cache_bytes) if config.disk_kv_cache_path else None
    shared = (lower(Tier.SHARED, config.shared_kv_bytes, config.shared_kv_total_bytes) if config.shared_kv_bucket
              else None)
    return tiers.attach(disk, shared)
