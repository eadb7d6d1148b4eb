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

Each entry keeps the tier of the replica's copy (``router.tiers``): a block
re-inserted at another tier moves there. Blocks in the deployment's shared
store are entries of one pseudo-holder, ``SHARED_STORE``, and count for every
replica in ``match_tiers``:

    prompt blocks   h0      h1      h2      h3
    replica a       DEVICE  HOST    .       .
    shared store    SHARED  SHARED  SHARED  .
    match_tiers     a: (DEVICE, HOST, SHARED); any other replica: (SHARED, SHARED, SHARED)

A replica's own copy wins over the shared store's: the engine looks through
its own tiers first, and each of them is faster.

Memory is bounded by ``max_blocks`` (hash, replica) entries. Past the bound the
least recently inserted entry goes first. A prompt's blocks are inserted last
block first, so under pressure a prompt's tail is forgotten before its head,
the same order in which the engine frees them.

A routed prompt's held head (its tenant's context) is moved up only once it has
aged: once a quarter of the bound's entries were touched after it
(``REFRESH_AGE``). A hot context is then walked once per that many entries, not
once per request, and it still never reaches the old end while it is in use.
The price: a tail inserted after a head that was not moved may outlive it, by
at most that quarter. A run stops at the first missing block, so such a tail
is never matched, only counted until it goes.

A replica's run of a prompt is found without a step per block where the
index knows the run is whole: each replica keeps the blocks it holds together
with every block before them in their prompt (``_Whole``), learnt from a
routed prompt (``insert(..., prompt=True)``: all of it held once inserted)
and from each run found by a walk. That set is closed under "the block
before", so a prompt's known blocks are a leading run, found by a binary
search; a walk goes on only past it, usually over a new turn's own blocks.
A block that stops being held leaves the set; where it was not the last of
its chain there, the replica's set is dropped whole, to be learnt again.

Pure Python, no Ray: one instance per router, not shared between processes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import chain, repeat, takewhile
from typing import Iterable, Sequence

from router.tiers import Tier

# The pseudo-holder of blocks in the deployment's shared store; no replica id looks like it.
SHARED_STORE = "<shared store>"
_NO_HOLDERS: dict[str, int] = {}
# A held run is moved up once more than max_blocks / REFRESH_AGE entries were touched after it (module doc).
REFRESH_AGE = 4


class PrefixIndex:
    """Bounded map from block hash to the replicas holding that block and their tiers, with LRU eviction."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        # block hash -> {replica id: the tier of its copy}, in insertion order.
        self._holders: dict[bytes, dict[str, int]] = {}
        # (block hash, replica id) entries, least recently inserted first, each with a clock no later than its
        # last touch's (a held head moved up restamps only its oldest entry, the one ``insert`` reads).
        self._lru: OrderedDict[tuple[bytes, str], int] = OrderedDict()
        self._clock = 0  # entries touched so far: an entry touched at t has at most _clock - t newer ones
        # replica id -> the hashes it holds, any tier: a replica's run of a prompt is one set lookup a block.
        self._held: dict[str, set[bytes]] = {}
        # replica id -> the blocks it holds with every block before them (module docstring); a subset of _held.
        self._whole: dict[str, _Whole] = {}
        self._num_off_device = 0  # entries in a tier other than DEVICE (shared-store ones too)
        self.num_dropped = 0  # entries forgotten to stay under max_blocks
        self.version = 0  # counts the changes: a run found at one version holds while it is unchanged

    def __len__(self) -> int:
        """The number of (block hash, replica) entries held, the shared store's included."""
        return len(self._lru)

    def __contains__(self, entry: tuple[bytes, str]) -> bool:
        return entry in self._lru

    def replica_ids(self) -> list[str]:
        """Replicas with at least one block in the index (never ``SHARED_STORE``)."""
        return [replica_id for replica_id in self._held if replica_id != SHARED_STORE]

    def num_blocks(self, replica_id: str) -> int:
        """How many blocks the index says ``replica_id`` (or ``SHARED_STORE``) holds."""
        return len(self._held.get(replica_id, ()))

    def tier(self, block_hash: bytes, replica_id: str) -> int | None:
        """The tier of ``replica_id``'s copy of ``block_hash``; None when the index has none."""
        return self._holders.get(block_hash, _NO_HOLDERS).get(replica_id)

    def insert(self, replica_id: str, block_hashes: Sequence[bytes], tier: int = Tier.DEVICE,
               held: int | None = None, prompt: bool = False) -> None:
        """Record that ``replica_id`` holds ``block_hashes`` (a prompt's leading blocks, in order) in ``tier``.

        Re-inserting a held block refreshes it and moves it to ``tier``. The
        blocks are touched last first, so the prompt's first block ends up the
        most recently used. Routing inserts on the device, where a prefill
        leaves a prompt's blocks; ``SHARED_STORE`` holds its blocks in ``Tier.SHARED``.

        A routed prompt's head is usually held already (its tenant's context,
        the history before this turn) and only its tail is new: where every
        entry is on the device, the held head is moved up only once it has
        aged (module doc), by ``map`` without a Python step per block, after
        the tail (the order the one-block-at-a-time path gives). ``held``:
        that run's length where the caller has just found it (``match_tiers``
        at this ``version``), so it is not walked again. ``prompt``: the
        blocks are a whole prompt's from its first (a routed prompt, not a
        replica's report of blocks it stored), so every one is held with all
        before it once inserted (module docstring).
        """
        self.version += 1
        head = 0
        if tier == Tier.DEVICE and not self._num_off_device and block_hashes:
            head = self._run_of(replica_id, block_hashes, prompt) if held is None else held
        self._touch(replica_id, block_hashes[head:], tier)
        lru = self._lru
        # The head's oldest entry is its last block's: the one touched first.
        oldest = (block_hashes[head - 1], replica_id) if head else None
        if head and self._clock - lru[oldest] > self.max_blocks // REFRESH_AGE:
            deque(map(lru.move_to_end, zip(reversed(block_hashes[:head]), repeat(replica_id))), maxlen=0)
            self._clock += head
            lru[oldest] = self._clock
        if prompt and block_hashes:
            whole = self._whole.setdefault(replica_id, _Whole())
            whole.add(block_hashes, len(block_hashes), whole.run(block_hashes))
        while len(lru) > self.max_blocks:
            (block_hash, holder), _ = lru.popitem(last=False)
            self._forget(block_hash, holder)
            self.num_dropped += 1

    def _touch(self, replica_id: str, block_hashes: Sequence[bytes], tier: int) -> None:
        """Add or refresh each of ``block_hashes``, last first, in ``tier``; the bound is the caller's."""
        if not block_hashes:
            return
        lru = self._lru
        held = self._held.setdefault(replica_id, set())
        off_device = tier != Tier.DEVICE
        self._clock += len(block_hashes)
        clock = self._clock
        for block_hash in reversed(block_hashes):
            key = (block_hash, replica_id)
            holders = self._holders.setdefault(block_hash, {})
            if key in lru:
                lru.move_to_end(key)
                lru[key] = clock
                self._num_off_device += off_device - (holders[replica_id] != Tier.DEVICE)
            else:
                lru[key] = clock
                held.add(block_hash)
                self._num_off_device += off_device
            holders[replica_id] = tier

    def _run_of(self, replica_id: str, block_hashes: Sequence[bytes], prompt: bool = False) -> int:
        """The length of ``replica_id``'s own leading run of ``block_hashes``, any tier.

        ``takewhile`` stops at the first block the replica's set lacks, in C.
        ``prompt``: ``block_hashes`` are a prompt's from its first block, so
        the part of them known whole (module docstring) is a binary search,
        the walk goes on past it only, and what it finds is known from then on.
        """
        held = self._held.get(replica_id)
        if not held:
            return 0
        if not prompt:
            return len(list(takewhile(held.__contains__, block_hashes)))
        whole = self._whole.get(replica_id)
        known = whole.run(block_hashes) if whole is not None else 0
        run = known + len(list(takewhile(held.__contains__, block_hashes[known:])))
        if run > known:
            (whole or self._whole.setdefault(replica_id, _Whole())).add(block_hashes, run, known)
        return run

    def evict(self, replica_id: str, block_hashes: Iterable[bytes]) -> None:
        """Record that ``replica_id`` no longer holds ``block_hashes``; unknown ones are ignored."""
        self.version += 1
        for block_hash in block_hashes:
            key = (block_hash, replica_id)
            if key in self._lru:
                del self._lru[key]
                self._forget(block_hash, replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget every block of ``replica_id`` (it died or left the pool). O(its blocks)."""
        self.version += 1
        self._whole.pop(replica_id, None)
        for block_hash in list(self._held.get(replica_id, ())):
            del self._lru[(block_hash, replica_id)]
            self._forget(block_hash, replica_id)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """For each replica holding the first block, the length of its leading run of ``block_hashes``.

        Counts the replicas' own copies in any tier, not the shared store's.
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
                    break
                alive = still
        else:
            for replica_id in alive:
                matches[replica_id] = len(block_hashes)
        matches.pop(SHARED_STORE, None)
        return matches

    def match_tiers(self, block_hashes: Sequence[bytes],
                    replica_ids: Iterable[str] | None = None) -> dict[str, tuple[int, ...]]:
        """For each of ``replica_ids`` that can reuse the first block, the tier of each block of its leading run.

        A block counts at the tier of the replica's own copy, else at
        ``Tier.SHARED`` when the shared store holds it (module docstring).
        ``replica_ids`` None means every replica with a block in the index.
        Replicas with an empty run are absent. ``block_hashes`` are a
        prompt's from its first block. It refreshes no entry, as ``match``
        does not; it learns which runs are whole (module docstring).
        """
        if not block_hashes:
            return {}
        wanted = dict.fromkeys(self.replica_ids() if replica_ids is None else replica_ids)  # an ordered set
        wanted.pop(SHARED_STORE, None)
        if not self._num_off_device:  # every entry is on a device: each wanted holder's run, found in C
            first = self._holders.get(block_hashes[0], _NO_HOLDERS)
            holding = [replica_id for replica_id in wanted if replica_id in first] if len(wanted) < len(first) \
                else [replica_id for replica_id in first if replica_id in wanted]
            return {replica_id: (Tier.DEVICE,) * self._run_of(replica_id, block_hashes, True) for replica_id in holding}
        first = self._holders.get(block_hashes[0], _NO_HOLDERS)
        alive = list(wanted) if SHARED_STORE in first else [r for r in first if r in wanted]
        runs: dict[str, list[int]] = {replica_id: [] for replica_id in alive}
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash, _NO_HOLDERS)
            shared = Tier.SHARED if SHARED_STORE in holders else None
            still = []
            for replica_id in alive:
                tier = holders.get(replica_id, shared)  # an own copy is always faster than the shared store
                if tier is not None:
                    runs[replica_id].append(tier)
                    still.append(replica_id)
            if not still:
                break
            alive = still
        return {replica_id: tuple(run) for replica_id, run in runs.items() if run}

    def deepest_holders(self, block_hashes: Sequence[bytes]) -> tuple[int, list[str]]:
        """``(blocks, replica_ids)``: the replicas holding the deepest of ``block_hashes`` that any replica
        holds (its own copy, in any tier), and how many blocks deep it is; ``(0, [])`` when none holds any.

        A binary search, O(log blocks) lookups and no step per replica. It
        counts on what chained hashes give: a replica holds a prompt's blocks
        as a leading run (both the engine and this index forget a prompt's
        tail before its head). Where a replica has a gap, the block found may
        not be the deepest, and a holder's run may be shorter than ``blocks``:
        ``match_tiers`` gives the exact runs of the replicas it is asked about.
        """
        holders_of = self._holders.get

        def held(position: int) -> bool:
            holders = holders_of(block_hashes[position])
            return bool(holders) and (len(holders) > 1 or SHARED_STORE not in holders)

        if not block_hashes or not held(0):
            return 0, []
        low, high = 0, len(block_hashes)  # held(low); nothing at or past high is known to be held
        while high - low > 1:
            middle = (low + high) // 2
            if held(middle):
                low = middle
            else:
                high = middle
        replica_ids = list(holders_of(block_hashes[low]))
        if SHARED_STORE in holders_of(block_hashes[low]):
            replica_ids.remove(SHARED_STORE)
        return low + 1, replica_ids

    def _forget(self, block_hash: bytes, replica_id: str) -> None:
        holders = self._holders[block_hash]
        self._num_off_device -= holders.pop(replica_id) != Tier.DEVICE
        if not holders:
            del self._holders[block_hash]
        held = self._held[replica_id]
        held.discard(block_hash)
        whole = self._whole.get(replica_id)
        if whole is not None and not whole.discard(block_hash):
            del self._whole[replica_id]
        if not held:
            del self._held[replica_id]
            self._whole.pop(replica_id, None)


class _Whole:
    """One replica's blocks known held together with every block before them in their prompt: closed under
    "the block before", so along any prompt the known blocks are a leading run.

    Each known block maps to the block after it where it was learnt (None
    for the last of what one ``add`` learnt), so a block has known blocks
    after it when that one is known, or when a later ``add`` started from it
    (``branches``). Learning a run is two passes in C and no per-block
    object.
    """

    __slots__ = ("after", "starts", "branches")

    def __init__(self) -> None:
        self.after: dict[bytes, bytes | None] = {}
        self.starts: dict[bytes, bytes | None] = {}  # the first block each add learnt -> the block before it
        self.branches: dict[bytes, int] = {}  # a known block -> the adds that started right after it

    def run(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes``' leading blocks are known: a binary search, as they are a leading run."""
        after = self.after
        if not block_hashes or block_hashes[0] not in after:
            return 0
        low, high = 0, len(block_hashes)  # block_hashes[low] is known; nothing at or past high is
        while high - low > 1:
            middle = (low + high) // 2
            if block_hashes[middle] in after:
                low = middle
            else:
                high = middle
        return low + 1

    def add(self, block_hashes: Sequence[bytes], end: int, known: int) -> None:
        """Know ``block_hashes[:end]`` (a prompt's leading blocks, each held), of which the first ``known``
        (``run``) are known already."""
        if end <= known:
            return
        self.after.update(zip(block_hashes[known:end], chain(block_hashes[known + 1:end], (None,))))
        before = block_hashes[known - 1] if known else None
        self.starts[block_hashes[known]] = before
        if before is not None:
            self.branches[before] = self.branches.get(before, 0) + 1

    def discard(self, block_hash: bytes) -> bool:
        """``block_hash`` is no longer held: forget it. False where known blocks come after it (they are not
        whole any more, and only a walk could find them): the caller then drops the whole set."""
        after = self.after
        if block_hash not in after:
            return True
        if after[block_hash] in after or block_hash in self.branches:
            return False
        del after[block_hash]
        if block_hash in self.starts:
            before = self.starts.pop(block_hash)
            if before is not None:
                left = self.branches[before] - 1
                if left:
                    self.branches[before] = left
                else:
                    del self.branches[before]
        return True
