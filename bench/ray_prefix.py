"""Ray Serve LLM's prefix-aware router, as a comparator in ``bench.router``.

Ray's router matches the prompt's text; here each of the prompt's engine
blocks is fed to Ray's ``PrefixTree`` as a fixed-length string derived from
its chained hash (``ray_block_text``), so the tree matches whole blocks, as
an engine can reuse them. ``ray`` is imported only when the router is built.
"""

from __future__ import annotations

import math

from bench.baseline_routers import PowerOfTwo
from sim.placement import Arrival, PoolView

# Fixed length of the string standing for one block. A block's first character
# is its id's lowest base-0xD000 digit (code points below the surrogates), so
# two blocks differ at their first character (but for 1 pair in 53,248) and the
# tree does not match part of a block.
RAY_BLOCK_CHARS = 4
_RAY_ALPHABET = 0xD000


def ray_block_text(block_id: int) -> str:
    """The ``RAY_BLOCK_CHARS``-character string that stands for block ``block_id`` in Ray's tree."""
    chars = []
    value = block_id % _RAY_ALPHABET**RAY_BLOCK_CHARS
    for _ in range(RAY_BLOCK_CHARS):
        value, digit = divmod(value, _RAY_ALPHABET)
        chars.append(chr(digit))
    return "".join(chars)


def hash_number(block_hash: bytes) -> int:
    """An engine block's chained hash as a number."""
    return int.from_bytes(block_hash[:8], "big")


class RayPrefixRouter(PowerOfTwo):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` decision over Ray's own ``PrefixTree``.

    Mirrors ray 2.60 ``_prefix_match_best_replicas`` and ``choose_replicas``:
    draw the power-of-two fallback; if the spread of queue lengths is within
    the imbalance threshold, match the prompt in the tree; below the match-rate
    threshold take the tenants with the fewest characters in the tree, else the
    tenants owning the deepest matched node; with no candidates, the fallback.
    Serve then sends the request to the candidate with the shortest queue (the
    first on a tie), and ``on_request_routed`` inserts the prompt for it. The
    tree never hears of cache evictions: Ray's eviction loop is off by default,
    and trims by size rather than from replica reports. Queue lengths are the
    requests in flight.
    """

    def __init__(self, seed: int, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1) -> None:
        from autoscale.ray_internals import ray_prefix_tree

        super().__init__(seed)
        self.tree = ray_prefix_tree()
        self._tenants: set[str] = set()
        self._imbalanced_threshold = imbalanced_threshold
        self._match_rate_threshold = match_rate_threshold

    def place(self, arrival: Arrival, pool: PoolView) -> str:
        replica_ids = pool.replica_ids
        new = [replica_id for replica_id in replica_ids if replica_id not in self._tenants]
        if new:
            self.tree.add_tenants(new, arrival.now_s)
            self._tenants.update(new)
        text = "".join(ray_block_text(hash_number(h)) for h in arrival.block_hashes)
        fallback = super().place(arrival, pool)
        queue_lens = {replica_id: pool.in_flight(replica_id) for replica_id in replica_ids}
        chosen: list[str] = []
        if text and max(queue_lens.values()) - min(queue_lens.values()) <= self._imbalanced_threshold:
            matched_text, matched_ids = self.tree.prefix_match(text, replica_ids)
            if len(matched_text) / len(text) < self._match_rate_threshold:
                chosen = self.tree.get_smallest_tenants() or []
            else:
                chosen = matched_ids or []
        replica_id = min(chosen, key=lambda r: queue_lens[r]) if chosen else fallback
        if text:
            self.tree.insert(text, replica_id, arrival.now_s)
        return replica_id
