"""The host tier: prefix blocks the device pool evicts are copied to a block-major pool in host memory.

A later prompt that runs past the device pool's prefix hits continues its
match here; the blocks found are copied back into device blocks
(``pd.engine.tiers.tiers``), so to the scheduler they are device hits.

    device pool  --evict-->  demote: copy the block, keyed by its hash (LRU)
    host pool    --match-->  promote: copy into fresh device blocks, cached there
    disk, store  --load--->  slots taken with ``take_slots``, filled, then ``admit``-ted

Each entry keeps its block's tokens, and a match verifies them, as the device
prefix cache does. The host pool is inclusive: a promoted block stays here
too, so evicting it from the device again copies nothing. A promotion copies
all its blocks in one call: on CPU one memcpy per block (``pd_kernels.cpu``),
on a GPU one copy per run of consecutive host slots from a pinned pool.

A demotion copies nothing on the allocation path: it takes and indexes a
slot, pinned, and queues the copy. ``flush`` issues every queued copy at
once: the engine calls it after scheduling, before anything writes to the
device blocks just reused (the step's KV stores, pulls); a promotion and a
load's ``take_slots`` call it first. On CPU the batch is one
``pd_kernels.cpu.copy_blocks`` call over the engine's threads. On a GPU it is
queued on a stream of its own, and the compute stream waits for it there,
so neither the host nor a step waits for it; ``settle`` waits for it where
the host itself reads a slot (the disk tier's write-through) or hands a slot
to a load.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Sequence

import torch

import pd_kernels.cpu as cpu_kernels
from pd.engine.tiers.stats import HostTierStats
from router.tiers import Tier


class HostTier:
    def __init__(self, device_cache: torch.Tensor, num_blocks: int,
                 on_drop: Callable[[bytes], None] | None = None) -> None:
        """``on_drop`` is called with a block hash as its entry leaves the tier (to make room)."""
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.device_cache = device_cache  # [num_device_blocks, *block]
        # A pool on the meta device (the simulator's: no byte exists) gets a host pool there too, and copies nothing.
        self.copies = not device_cache.is_meta
        self.cache = torch.empty((num_blocks, *device_cache.shape[1:]), dtype=device_cache.dtype,
                                 device="cpu" if self.copies else "meta", pin_memory=device_cache.is_cuda)
        self.num_blocks = num_blocks
        self.block_bytes = self.cache[0].nbytes
        if self.copies and not device_cache.is_cuda:
            cpu_kernels.build()  # promotions copy with it; compiled once, at engine start
        # block hash -> (host slot, the block's tokens); oldest use first.
        self._index: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        # How many hold each slot (a promotion, a load or a waiting request): a held slot is never reused.
        # A list, not a dict: promotions unpin a slot per block, on the step's path.
        self._pins = [0] * num_blocks
        self._num_pinned = 0
        self.stats = HostTierStats(host_capacity_blocks=num_blocks)
        self.on_drop = on_drop
        self._pending: list[tuple[int, int]] = []  # (device block, host slot): demoted, copy not yet issued
        # On a GPU: the stream demotions copy on, and the event of the last batch issued there.
        self._stream = torch.cuda.Stream(device_cache.device) if device_cache.is_cuda else None
        self._issued: torch.cuda.Event | None = None

    def demote(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> Tier | None:
        """Keep device block ``block_id`` (cached as ``block_hash``) here: its copy is issued by ``flush``,
        which must run before the device writes to the block again.

        Returns the tier that holds it from now on (None: dropped).
        """
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return Tier.HOST
        slot = self._take_slot()
        if slot is None:
            return None  # every slot is being read by a promotion: this block is dropped, as without a tier
        if self.copies:
            self._pin(slot)  # neither reused nor read before its copy is issued
            self._pending.append((block_id, slot))
        self._index[block_hash] = (slot, tuple(token_ids))
        self.stats.num_demoted_blocks += 1
        self.stats.num_host_cached_blocks = len(self._index)
        return Tier.HOST

    @property
    def num_pending_demotions(self) -> int:
        """Demoted blocks whose copies ``flush`` has yet to issue."""
        return len(self._pending)

    def flush(self) -> None:
        """Issue the copies of every block demoted since the last flush, as one batch (see the module docstring)."""
        if not self._pending:
            return
        started = time.perf_counter()
        pending, self._pending = self._pending, []
        block_ids, slots = [block_id for block_id, _ in pending], [slot for _, slot in pending]
        if self._stream is not None:
            compute = torch.cuda.current_stream(self.device_cache.device)
            self._stream.wait_stream(compute)  # the blocks' last writes land before they are read
            with torch.cuda.stream(self._stream):
                for block_id, slot in pending:
                    self.cache[slot].copy_(self.device_cache[block_id], non_blocking=True)
                self._issued = torch.cuda.Event()
                self._issued.record(self._stream)
            compute.wait_stream(self._stream)  # the next writes to those blocks wait for the copies, on the GPU
        else:
            cpu_kernels.copy_blocks(self.device_cache, block_ids, self.cache, slots)
        for slot in slots:
            self._unpin(slot)
        self.stats.demote_seconds += time.perf_counter() - started

    def settle(self) -> None:
        """``flush``, then (on a GPU) wait until the copies have landed: the host reads or hands out slots next."""
        self.flush()
        if self._issued is not None:
            self._issued.synchronize()
            self._issued = None

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def slot_of(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash``, or None."""
        entry = self._index.get(block_hash)
        return entry[0] if entry is not None else None

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for _ in range(2):
            for block_hash, (slot, _) in self._index.items():  # least recently used first
                if not self._pins[slot]:
                    del self._index[block_hash]
                    self.stats.num_host_cached_blocks = len(self._index)
                    if self.on_drop is not None:
                        self.on_drop(block_hash)
                    return slot
            if not self._pending:
                return None
            self.flush()  # every slot waits on a copy: issue them, and the oldest can go
        return None

    def take_slots(self, num_slots: int) -> list[int]:
        """Up to ``num_slots`` slots for a load from a lower tier, held until ``admit`` or ``give_back``."""
        self.settle()  # a load writes into its slots from another thread: no copy may still land there
        slots = []
        while len(slots) < num_slots and (slot := self._take_slot()) is not None:
            self._pin(slot)
            slots.append(slot)
        return slots

    def admit(self, slot: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Index a slot that a load filled with ``block_hash``; it stays reserved until ``unreserve``."""
        existing = self._index.get(block_hash)
        if existing is not None:  # it came back meanwhile (demoted, or another load): keep that copy
            self._pin(existing[0])
            self.give_back([slot])
            return
        self._index[block_hash] = (slot, tuple(token_ids))
        self.stats.num_host_cached_blocks = len(self._index)

    def unreserve(self, block_hashes: Sequence[bytes]) -> None:
        """End reservations taken with ``reserve`` or ``admit`` that no promotion consumed."""
        for block_hash in block_hashes:
            self._unpin(self._index[block_hash][0])

    def _pin(self, slot: int) -> None:
        if not self._pins[slot]:
            self._num_pinned += 1
        self._pins[slot] += 1

    def _unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            self._num_pinned -= 1

    @property
    def num_pinned_slots(self) -> int:
        return self._num_pinned

    def give_back(self, slots: Sequence[int]) -> None:
        """Slots taken with ``take_slots`` that no load filled."""
        for slot in slots:
            self._unpin(slot)
            self._free_slots.append(slot)

    def match(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
              start: int) -> list[bytes]:
        """The hashes of the run of blocks held here for ``block_hashes``, the first being block ``start``."""
        found = []
        for index, block_hash in enumerate(block_hashes, start):
            entry = self._index.get(block_hash)
            if entry is None or entry[1] != tuple(token_ids[index * block_size:(index + 1) * block_size]):
                break
            found.append(block_hash)
        return found

    def reserve(self, block_hashes: Sequence[bytes]) -> None:
        """Keep these entries' slots from reuse until ``promote`` (demotions may run in between)."""
        for block_hash in block_hashes:
            self._index.move_to_end(block_hash)
            self._pin(self._index[block_hash][0])

    def promote(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """Copy reserved entries into device blocks ``block_ids``, one to one; their tokens."""
        self.flush()  # the blocks written may be ones just demoted, and the entries read may be demoted ones
        started = time.perf_counter()
        entries = [self._index[block_hash] for block_hash in block_hashes]
        slots = [slot for slot, _ in entries]
        if not self.copies:
            pass
        elif self.device_cache.is_cuda:
            start = 0
            for end in range(1, len(slots) + 1):  # one host-to-device copy per run of consecutive slots
                if end == len(slots) or slots[end] != slots[end - 1] + 1:
                    ids = torch.tensor(block_ids[start:end], device=self.device_cache.device)
                    run = self.cache[slots[start]:slots[end - 1] + 1].to(self.device_cache.device, non_blocking=True)
                    self.device_cache.index_copy_(0, ids, run)
                    start = end
        else:
            cpu_kernels.copy_blocks(self.cache, slots, self.device_cache, list(block_ids))
        pins = self._pins  # _unpin, inline: this runs once per promoted block, on the step's path
        for slot in slots:
            pins[slot] -= 1
            if not pins[slot]:
                self._num_pinned -= 1
        self.stats.num_promoted_blocks += len(slots)
        self.stats.num_promoted_bytes += len(slots) * self.block_bytes
        self.stats.promote_seconds += time.perf_counter() - started
        return [tokens for _, tokens in entries]
