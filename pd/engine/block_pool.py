"""The block pool: ids, reference counts, a free LRU and the prefix cache.

Pure Python; it never imports torch. A block is a page of ``block_size``
token slots in the KV pool. A block is *used* while its reference count is
above zero. A free block may still hold a cached prefix: it stays findable
until it is taken for a new allocation, which evicts it.

    free queue (LRU):  head -> [oldest free ... most recently freed] <- tail
    allocate() pops from the head; free() appends to the tail.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Iterable, Sequence

from router.events import CacheEvent
from router.tiers import Tier

# How many prefix-cache events a pool keeps for routers to read.
MAX_CACHE_EVENTS = 4096


class CacheEventLog:
    """Numbered prefix-cache events (``router.events.CacheEvent``: what routers read, unconverted), the newest
    ``max_events`` of them."""

    def __init__(self, max_events: int = MAX_CACHE_EVENTS):
        self._events: deque[CacheEvent] = deque(maxlen=max_events)
        self._next_seq = 0

    def record(self, block_hash: bytes, stored: bool, tier: Tier = Tier.DEVICE) -> None:
        self._events.append(CacheEvent(self._next_seq, block_hash, stored, tier))
        self._next_seq += 1

    def window(self, after_seq: int | None = None) -> tuple[int, list[CacheEvent]]:
        """``(first_seq, events)``: every change still kept, compacted to each ``CacheEvent.key``'s latest.

        The window covers every event numbered ``first_seq`` or later; a reader
        that has applied events only up to ``first_seq - 2`` missed some.
        With ``after_seq``, only events numbered after it (a reader that has
        applied those already needs no more).
        """
        events = list(self._events)  # one C-level copy: safe against a step running on another thread
        first_seq = events[0].seq if events else self._next_seq
        if after_seq is not None and after_seq >= first_seq:
            events = events[after_seq + 1 - first_seq:]  # seqs are consecutive: the index is the offset
            first_seq = after_seq + 1
        latest = {e.key: e for e in events}
        return first_seq, sorted(latest.values(), key=lambda e: e.seq)


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


# Called with (block id, hash, tokens) as a cached block is evicted, before the block is reused;
# returns the lower tier that holds the block from then on, or None.
OnEvict = Callable[[int, bytes, tuple[int, ...]], Tier | None]


class Evictions:
    """Where a pool's evicted cached blocks go: to the one lower tier bound to it, or nowhere.

    A pool takes this at construction. The KV tiers bind to it after: they are
    built from the pool (they look up, allocate and insert its blocks), so they
    cannot exist when it does. Until then, and always in an engine without
    tiers, an eviction goes nowhere.
    """

    def __init__(self) -> None:
        self._on_evict: OnEvict | None = None

    def bind(self, on_evict: OnEvict) -> None:
        if self._on_evict is not None:
            raise RuntimeError("a block pool's evictions already go to a lower tier")
        self._on_evict = on_evict

    def evicted(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> Tier | None:
        """The lower tier holding the block from now on, or None."""
        return None if self._on_evict is None else self._on_evict(block_id, block_hash, token_ids)


class BlockPool:
    def __init__(self, num_blocks: int, max_cache_events: int = MAX_CACHE_EVENTS, *,
                 evictions: Evictions | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}
        self._block_tokens: dict[int, tuple[int, ...]] = {}
        self.events = CacheEventLog(max_cache_events)
        self._evictions = evictions or Evictions()

    def cache_event_window(self, after_seq: int | None = None) -> tuple[int, list[CacheEvent]]:
        """See ``CacheEventLog.window``."""
        return self.events.window(after_seq)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether a block holds ``block_hash`` in the prefix cache."""
        return block_hash in self._hash_to_block

    def block_of(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash`` in the prefix cache, or None."""
        return self._hash_to_block.get(block_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` from the head of the free queue, evicting cached prefixes."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the tail, in order."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (prefix hits), taking free ones out of the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def match(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int) -> list[int]:
        """The longest run of cached blocks for ``block_hashes``, verified against the tokens.

        Changes no reference count; call ``touch`` on what is kept.
        """
        block_ids = []
        for index, block_hash in enumerate(block_hashes):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            if self._block_tokens[block_id] != tuple(tokens):
                break
            block_ids.append(block_id)
        return block_ids

    def num_cached_leading(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes``, from the first, the prefix cache holds (by hash alone; ``match``
        checks the tokens too). Reads only."""
        hash_to_block = self._hash_to_block
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in hash_to_block:
                return index
        return len(block_hashes)

    def insert(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Make a full, computed block findable by its hash.

        If another block already holds the same prefix, the first one stays
        the cached copy and this block stays private.
        """
        if block_hash in self._hash_to_block or block_id in self._block_hash:
            return
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        self._block_tokens[block_id] = tuple(token_ids)
        self.events.record(block_hash, stored=True)

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash.pop(block_id, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            tokens = self._block_tokens.pop(block_id)
            lower = self._evictions.evicted(block_id, block_hash, tokens)
            self.events.record(block_hash, stored=lower is not None, tier=Tier.DEVICE if lower is None else lower)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (used blocks keep their contents)."""
        for block_hash in self._hash_to_block:
            self.events.record(block_hash, stored=False)
        self._hash_to_block.clear()
        self._block_hash.clear()
        self._block_tokens.clear()
