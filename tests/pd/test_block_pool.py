"""Exact block ids and eviction order of the pure-Python block pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pd.engine.block_pool import BlockPool, Evictions, NoFreeBlocksError
from pd.engine.kv_cache_manager import KVCacheManager
from pd.engine.request import Request
from pd.sampling_params import SamplingParams
from router.hashing import hash_block_tokens
from router.tiers import Tier


def test_allocate_takes_lowest_ids_first_and_free_appends_in_order():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 3
    pool.free([2, 0])
    # Free queue: 3, 4, 5, then the freed 2, 0.
    assert pool.allocate(5) == [3, 4, 5, 2, 0]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_double_free_is_an_error():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_cached_free_blocks_are_evicted_in_lru_order():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.insert(block, bytes([i]) * 8, [i])
    pool.free([3, 1, 0, 2])
    assert pool.num_cached_blocks == 4 and pool.num_used_blocks == 0
    # The head of the free queue (block 3) is evicted first, then 1.
    assert pool.allocate(2) == [3, 1]
    assert pool.match([bytes([3]) * 8], [3], 1) == []
    assert pool.match([bytes([1]) * 8], [1], 1) == []
    assert pool.match([bytes([0]) * 8], [0], 1) == [0]
    assert pool.num_cached_blocks == 2


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    [a, b, c] = pool.allocate(3)
    pool.insert(a, b"h" * 8, [7])
    pool.free([a, b, c])
    pool.touch([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 2
    assert pool.allocate(2) == [b, c]


def test_match_verifies_tokens_and_stops_at_first_miss():
    pool = BlockPool(4)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = hash_block_tokens(tokens, 2)
    blocks = pool.allocate(3)
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        pool.insert(block, h, tokens[2 * i : 2 * i + 2])
    assert pool.match(hashes, tokens, 2) == blocks
    # Same hashes, different tokens in block 1: a hash collision must not hit.
    assert pool.match(hashes, [1, 2, 9, 9, 5, 6], 2) == blocks[:1]


def _request(rid, tokens, max_tokens=4):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def test_kv_manager_prefix_hit_leaves_last_token_and_frees_everything():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, block_size=4)
    first = _request("a", list(range(8)))
    assert manager.allocate_slots(first, 8)
    assert manager.block_ids("a") == [0, 1]
    first.num_computed_tokens = 8
    manager.cache_blocks(first)
    # A prompt equal to the cached 8 tokens reuses only block 0: its last token must be computed.
    same = _request("b", list(range(8)))
    match = manager.match_prefix(same)
    assert match.block_ids == [0] and match.num_tokens == 4
    longer = _request("c", list(range(8)) + [100])
    assert manager.match_prefix(longer).block_ids == [0, 1]
    assert manager.allocate_slots(longer, 1, manager.match_prefix(longer))
    assert manager.block_ids("c") == [0, 1, 2]
    assert pool.ref_count(0) == 2
    manager.free(first)
    manager.free(longer)
    assert pool.num_used_blocks == 0
    # Freed last-block-first: the uncached tail block 2 is evicted before the cached prefix.
    assert pool.allocate(1) == [3]


def test_allocate_slots_is_all_or_nothing():
    pool = BlockPool(3)
    manager = KVCacheManager(pool, block_size=4)
    request = _request("a", list(range(16)))
    assert not manager.allocate_slots(request, 16)
    assert pool.num_free_blocks == 3 and manager.block_ids("a") == []


def test_cache_event_window_keeps_each_hashs_latest_event_and_says_where_it_starts():
    pool = BlockPool(2)
    assert pool.cache_event_window() == (0, [])
    a, b = pool.allocate(2)
    pool.insert(a, b"a" * 8, [1])
    pool.insert(b, b"b" * 8, [2])
    pool.free([a, b])
    pool.allocate(1)  # evicts a
    first_seq, events = pool.cache_event_window()
    assert first_seq == 0
    assert [(e.seq, e.block_hash, e.stored) for e in events] == [(1, b"b" * 8, True), (2, b"a" * 8, False)]

    small = BlockPool(1, max_cache_events=2)
    for i in range(3):  # three prefixes in turn: three stores and two evictions, two events kept
        [block] = small.allocate(1)
        small.insert(block, bytes([i]) * 8, [i])
        small.free([block])
    first_seq, events = small.cache_event_window()
    assert first_seq == 3 and [(e.seq, e.stored) for e in events] == [(3, False), (4, True)]
    assert small.cache_event_window(after_seq=3) == (4, [events[1]])  # what a reader has not applied yet
    assert small.cache_event_window(after_seq=4) == (5, [])
    assert small.cache_event_window(after_seq=1) == (3, events)  # older than the window: the whole window


def test_an_eviction_goes_to_the_tier_bound_to_the_pool_and_its_event_names_that_tier():
    evictions = Evictions()
    pool = BlockPool(1, evictions=evictions)
    [block] = pool.allocate(1)
    pool.insert(block, b"a", (1,))
    pool.free([block])
    pool.allocate(1)  # unbound: the block goes nowhere
    evictions.bind(lambda block_id, block_hash, tokens: Tier.HOST)
    with pytest.raises(RuntimeError, match="already"):
        evictions.bind(lambda block_id, block_hash, tokens: None)
    pool.insert(block, b"b", (2,))
    pool.free([block])
    pool.allocate(1)
    _, events = pool.cache_event_window()
    assert [(e.block_hash, e.stored, e.tier) for e in events] == [(b"a", False, Tier.DEVICE), (b"b", True, Tier.HOST)]


# Loads block_pool.py alone (not through ``pd``, whose package imports the engine) with torch unimportable.
PURE = """
import importlib.util, sys
sys.modules["torch"] = None
spec = importlib.util.spec_from_file_location("block_pool", sys.argv[1])
pool_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pool_module)
pool = pool_module.BlockPool(2)
pool.insert(pool.allocate(1)[0], b"h", (1,))
print(pool.cache_event_window()[1][0].tier.name)
"""


@pytest.mark.integration  # a child Python, so that the import state is a fresh process's
def test_the_block_pool_and_its_events_never_import_torch():
    path = Path(__file__).parents[2] / "pd" / "engine" / "block_pool.py"
    done = subprocess.run([sys.executable, "-c", PURE, str(path)], capture_output=True, text=True, timeout=60,
                          cwd=path.parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "DEVICE", done.stderr[-2000:]
