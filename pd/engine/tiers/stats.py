"""The KV tiers' counters, and how they read as ``EngineStats`` fields. Pure Python: no torch.

An engine without tiers reports these at zero (``pd.engine.tiers.base.NoTiers``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HostTierStats:
    num_demoted_blocks: int = 0  # copied in from the device pool, cumulative
    num_promoted_blocks: int = 0  # copied back to the device pool on a prefix hit, cumulative
    num_host_cached_blocks: int = 0  # held now
    host_capacity_blocks: int = 0
    num_promoted_bytes: int = 0
    promote_seconds: float = 0.0  # copying to the device, cumulative
    demote_seconds: float = 0.0  # copying from the device, cumulative


@dataclass
class StoreTierStats:
    num_written_blocks: int = 0
    num_dropped_writes: int = 0  # not written: gone from device and host, or past the backlog, before a write
    num_pending_writes: int = 0  # in flight now
    num_read_blocks: int = 0
    num_read_bytes: int = 0
    read_seconds: float = 0.0
    num_rejected_reads: int = 0  # missing, short or not the block asked for: recomputed
    num_store_queries: int = 0  # shared store: questions of which blocks it holds
    num_deleted_blocks: int = 0  # this replica's own writes, past its capacity
    num_collected_blocks: int = 0  # any writer's, past the store's total (``total_capacity_blocks``)
    num_blocks: int = 0  # indexed now
    capacity_blocks: int = 0
    disabled: int = 0  # 1 once a write failed (a disk full): no more writes


def tier_counters(host: HostTierStats, disk: StoreTierStats, shared: StoreTierStats) -> dict[str, int | float]:
    """The tiers' counters under ``EngineStats`` names: the host's as they are, the others prefixed
    ``disk_`` and ``shared_`` with ``num_`` dropped. Pass zeros (a fresh stats object) for a tier not configured."""
    values: dict[str, int | float] = dict(vars(host))
    for prefix, stats in (("disk", disk), ("shared", shared)):
        for name, value in vars(stats).items():
            values[f"{prefix}_{name.removeprefix('num_')}"] = value
    return values
