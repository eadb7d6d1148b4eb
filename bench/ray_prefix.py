"""Ray Serve LLM's prefix-aware router, as a comparator in ``bench.router``.

Each trace block id is fed to Ray's ``PrefixTree`` as a fixed-length
synthesized string (``ray_block_text``); ``ray`` is imported only when the
router is built.
"""

from __future__ import annotations

import math

from bench.baseline_routers import PowerOfTwo, replica_name
from bench.replica_model import PoolView
from bench.trace import TraceRequest

# Fixed length of the string standing for one block. A block's first character
# is its id's lowest base-0xD000 digit (code points below the surrogates), so
# blocks diverge at their first character and the tree never matches part of one.
RAY_BLOCK_CHARS = 4
_RAY_ALPHABET = 0xD000


def ray_block_text(hash_id: int) -> str:
    """The ``RAY_BLOCK_CHARS``-character string that stands for block ``hash_id`` in Ray's tree."""
    chars = []
    value = hash_id
    for _ in range(RAY_BLOCK_CHARS):
        value, digit = divmod(value, _RAY_ALPHABET)
        chars.append(chr(digit))
    return "".join(chars)


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
    and trims by size rather than from replica reports.
    """

    def __init__(self, num_replicas: int, seed: int, imbalanced_threshold: float = math.inf,
                 match_rate_threshold: float = 0.1) -> None:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        super().__init__(num_replicas, seed)
        self.tree = PrefixTree()
        self._names = [replica_name(replica) for replica in range(num_replicas)]
        self._replica_by_name = {name: replica for replica, name in enumerate(self._names)}
        self.tree.add_tenants(self._names, 0.0)
        self._imbalanced_threshold = imbalanced_threshold
        self._match_rate_threshold = match_rate_threshold

    def prepare(self, request: TraceRequest, pool: PoolView) -> str:
        return "".join(ray_block_text(h) for h in request.hash_ids)

    def route(self, text: str, pool: PoolView) -> int:
        fallback = super().route(None, pool)
        queue_lens = [pool.queue_len(replica) for replica in range(len(self._names))]
        chosen_names: list[str] = []
        if max(queue_lens) - min(queue_lens) <= self._imbalanced_threshold:
            matched_text, matched_names = self.tree.prefix_match(text, self._names)
            if len(matched_text) / len(text) < self._match_rate_threshold:
                chosen_names = self.tree.get_smallest_tenants() or []
            else:
                chosen_names = matched_names or []
        replica = fallback
        if chosen_names:
            replica = min((self._replica_by_name[name] for name in chosen_names), key=lambda r: queue_lens[r])
        self.tree.insert(text, self._names[replica], pool.now_s)
        return replica
