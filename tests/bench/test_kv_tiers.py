"""bench.kv_tiers' pieces on small shapes: the copy comparison and the working-set count."""

from __future__ import annotations

from bench.kv_tiers import BLOCK_SIZE, copy_speeds, distinct_blocks


def test_copy_speeds_compare_promotions_with_one_memcpy_of_the_same_bytes():
    row = copy_speeds((2, 2, 4), num_blocks=8, repeats=2)
    assert row["copy_bytes"] == 8 * 2 * 2 * 4 * 4
    assert row["host_to_device_gb_per_s"] > 0 and row["memcpy_gb_per_s"] > 0
    assert row["host_ratio_vs_memcpy"] > 0


def test_the_working_set_counts_shared_blocks_once():
    shared = list(range(2 * BLOCK_SIZE))
    prompts = [(shared + [1] * BLOCK_SIZE, 1), (shared + [2] * BLOCK_SIZE, 1), (shared[:BLOCK_SIZE], 1)]
    assert distinct_blocks(prompts) == 2 + 1 + 1
