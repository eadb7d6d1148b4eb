"""Which replica holds which prefix blocks, keyed by the engine's chained block hashes.

The index learns from two sources: replicas' reports of blocks they stored or
evicted, and optimistic insertion when the router sends a request somewhere
(that replica will hold the prompt's blocks once it has prefilled it).

Hashes chain (``router.hashing``), so a replica holding block ``i`` held blocks
``0..i-1`` when it inserted it. A replica's match is the longest leading run of
a prompt's blocks that the index says it holds:

    prompt blocks   h0  h1  h2  h3
    replica a       x   x   x   .      -> 3
    replica b       x   .   x   .      -> 1  (h2 without h1 cannot be reused)

Memory is bounded by ``max_blocks`` (hash, replica) entries. Past the bound the
least recently inserted entry goes first. A prompt's blocks are inserted last
block first, so under pressure a prompt's tail is forgotten before its head,
the same order in which the engine frees them.

Pure Python, no Ray: one instance per router, not shared between processes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class PrefixIndex:
    """Bounded map from block hash to the replicas holding that block, with LRU eviction."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        # block hash -> replica ids holding it (a dict used as an ordered set).
        self._holders: dict[bytes, dict[str, None]] = {}
        # (block hash, replica id) entries, least recently inserted first.
        self._lru: OrderedDict[tuple[bytes, str], None] = OrderedDict()
        self._num_blocks_by_replica: dict[str, int] = {}
        self.num_dropped = 0  # entries forgotten to stay under max_blocks

    def __len__(self) -> int:
        """The number of (block hash, replica) entries held."""
        return len(self._lru)

    def __contains__(self, entry: tuple[bytes, str]) -> bool:
        return entry in self._lru

    def replica_ids(self) -> list[str]:
        """Replicas with at least one block in the index."""
        return list(self._num_blocks_by_replica)

    def num_blocks(self, replica_id: str) -> int:
        """How many blocks the index says ``replica_id`` holds."""
        return self._num_blocks_by_replica.get(replica_id, 0)

    def insert(self, replica_id: str, block_hashes: Sequence[bytes]) -> None:
        """Record that ``replica_id`` holds ``block_hashes`` (a prompt's leading blocks, in order).

        Re-inserting a held block refreshes it. The blocks are touched last
        first, so the prompt's first block ends up the most recently used.
        """
        lru = self._lru
        for block_hash in reversed(block_hashes):
            key = (block_hash, replica_id)
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = None
            self._holders.setdefault(block_hash, {})[replica_id] = None
            self._num_blocks_by_replica[replica_id] = self._num_blocks_by_replica.get(replica_id, 0) + 1
        while len(lru) > self.max_blocks:
            (block_hash, holder), _ = lru.popitem(last=False)
            self._forget(block_hash, holder)
            self.num_dropped += 1

    def evict(self, replica_id: str, block_hashes: Iterable[bytes]) -> None:
        """Record that ``replica_id`` no longer holds ``block_hashes``; unknown ones are ignored."""
        for block_hash in block_hashes:
            key = (block_hash, replica_id)
            if key in self._lru:
                del self._lru[key]
                self._forget(block_hash, replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget every block of ``replica_id`` (it died or left the pool). O(len(self))."""
        if replica_id not in self._num_blocks_by_replica:
            return
        doomed = [key for key in self._lru if key[1] == replica_id]
        for key in doomed:
            del self._lru[key]
            self._forget(*key)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """For each replica holding the first block, the length of its leading run of ``block_hashes``.

        Replicas that hold none of the leading blocks are absent. Read-only:
        matching does not refresh entries (routing inserts, which does).
        """
        matches: dict[str, int] = {}
        if not block_hashes:
            return matches
        alive = self._holders.get(block_hashes[0])
        if not alive:
            return matches
        alive = set(alive)
        for position in range(1, len(block_hashes)):
            holders = self._holders.get(block_hashes[position])
            still = alive.intersection(holders) if holders else set()
            if len(still) < len(alive):
                for replica_id in alive.difference(still):
                    matches[replica_id] = position
                if not still:
                    return matches
                alive = still
        for replica_id in alive:
            matches[replica_id] = len(block_hashes)
        return matches

    def _forget(self, block_hash: bytes, replica_id: str) -> None:
        holders = self._holders[block_hash]
        del holders[replica_id]
        if not holders:
            del self._holders[block_hash]
        remaining = self._num_blocks_by_replica[replica_id] - 1
        if remaining:
            self._num_blocks_by_replica[replica_id] = remaining
        else:
            del self._num_blocks_by_replica[replica_id]
