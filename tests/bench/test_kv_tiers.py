"""bench.kv_tiers' pieces on small shapes: the tiers' speed comparisons and the working-set count."""

from __future__ import annotations

from bench import tier_speeds
from bench.kv_tiers import BLOCK_SIZE, distinct_blocks


def test_promotions_are_compared_with_one_memcpy_of_the_same_bytes():
    row = tier_speeds.host_to_device((64, 256), num_blocks=8, repeats=2)  # 64 KiB blocks
    assert row["block_bytes"] == 64 * 256 * 4
    assert row["host_to_device_gb_per_s"] > 0 and row["memcpy_gb_per_s"] > 0 and row["host_ratio_vs_memcpy"] > 0


def test_disk_reads_are_compared_with_plain_reads_of_the_same_files():
    row = tier_speeds.disk_to_host((64, 256), num_blocks=8, block_size=4, repeats=2)
    assert row["disk_read_gb_per_s"] > 0 and row["plain_read_gb_per_s"] > 0 and row["disk_ratio_vs_plain"] > 0
    assert row["disk_ratio_one_run_at_a_time"] > 0


def test_the_working_set_counts_shared_blocks_once():
    shared = list(range(2 * BLOCK_SIZE))
    prompts = [(shared + [1] * BLOCK_SIZE, 1), (shared + [2] * BLOCK_SIZE, 1), (shared[:BLOCK_SIZE], 1)]
    assert distinct_blocks(prompts) == 2 + 1 + 1
