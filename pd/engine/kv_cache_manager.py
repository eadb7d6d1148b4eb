"""Maps requests to blocks: allocation, prefix-cache hits and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from pd.engine.block_pool import BlockPool
from pd.engine.request import Request
from pd.engine.tiers.base import NO_TIERS, Tiers
from router.hashing import hash_block_tokens


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks found for the start of a request; not yet referenced."""

    block_ids: list[int]
    num_tokens: int


NO_MATCH = PrefixMatch(block_ids=[], num_tokens=0)


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend ``request.block_hashes`` to every full block of its tokens."""
    hashes = request.block_hashes
    if len(hashes) < request.num_tokens // block_size:
        parent = hashes[-1] if hashes else request.hash_root
        hashes.extend(hash_block_tokens(request.token_ids, block_size, parent_hash=parent, start_block=len(hashes)))


class KVCacheManager:
    """``tiers``: host memory, disk, shared store below ``block_pool`` (``pd.engine.tiers``); none by default."""

    def __init__(self, block_pool: BlockPool, block_size: int, enable_prefix_caching: bool = True, *,
                 tiers: Tiers = NO_TIERS):
        self.pool = block_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[int]] = {}
        # How many leading blocks of each request are in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.tiers = tiers

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def update_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its tokens."""
        update_block_hashes(request, self.block_size)

    def cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens of a waiting ``request`` that its admission would find in the device pool now, as
        ``match_prefix`` would count them, without its checks of the tokens or its promotions from lower tiers.

        Reads only: safe from another thread (a report), on hashes the engine computed when it queued the
        request; a preempted request's newer tokens, not yet hashed, count as uncached.
        """
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.pool.num_cached_leading(request.block_hashes[:max_blocks]) * self.block_size

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Cached blocks for the request's leading full blocks.

        At least the last token is always left to compute, since the request
        needs its logits; a full hit therefore gives up its last block.
        """
        if not self.enable_prefix_caching:
            return NO_MATCH
        self.update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        block_ids = self.pool.match(hashes, request.token_ids, self.block_size)
        if len(block_ids) < max_blocks and self.tiers.promote(hashes, request.token_ids, self.block_size, block_ids):
            block_ids = self.pool.match(hashes, request.token_ids, self.block_size)
        self.tiers.release(request.request_id)  # what its loads reserved has served its turn
        return PrefixMatch(block_ids=block_ids, num_tokens=len(block_ids) * self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: PrefixMatch = NO_MATCH) -> bool:
        """Reference ``prefix`` and allocate blocks for ``num_new_tokens`` beyond it.

        All or nothing: returns False, changing nothing, when the pool is short.
        """
        blocks = self._blocks.get(request.request_id, [])
        num_tokens = request.num_scheduled_tokens + prefix.num_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(blocks) - len(prefix.block_ids)
        if num_needed <= 0 and not prefix.block_ids:  # a decode within its last block: most calls
            self._blocks[request.request_id] = blocks
            return True
        # Prefix hits sitting in the free queue leave it when referenced.
        num_free_hits = sum(1 for b in prefix.block_ids if self.pool.is_free(b))
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return False
        if prefix.block_ids:
            self.pool.touch(prefix.block_ids)
            blocks.extend(prefix.block_ids)
            self._num_cached_blocks[request.request_id] = len(prefix.block_ids)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        self._blocks[request.request_id] = blocks
        return True

    def cache_blocks(self, request: Request) -> None:
        """Insert the request's newly full, computed blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self.update_hashes(request)
        blocks = self._blocks[request.request_id]
        bs = self.block_size
        for index in range(start, num_full):
            tokens = request.token_ids[index * bs : (index + 1) * bs]
            self.pool.insert(blocks[index], request.block_hashes[index], tokens)
            self.tiers.on_cached(request.block_hashes[index], tokens)
        self._num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the ``num_tokens`` its tokens need (a verify step's rejected drafts).

        Such blocks were allocated for the drafts and hold no computed token, so none is in the prefix cache.
        """
        blocks = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(extra))

    def touch_blocks(self, block_ids: list[int]) -> None:
        """Hold one more reference on each block (a transfer writing into them)."""
        self.pool.touch(block_ids)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop a reference taken with ``touch_blocks``."""
        self.pool.free(block_ids)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so a prompt's tail is evicted before its head."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
