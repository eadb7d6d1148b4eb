"""How fast the KV tiers move blocks, against the physical copy each stands on, measured in the same run.

- host -> device: ``HostTier.promote`` of runs of ``RUN_BLOCKS`` blocks (a
  prompt's worth) into device blocks in a shuffled order, as an allocator
  hands them out; against copying the same bytes in place and in order, the
  fastest of torch's ``copy_`` and the tier's own streamed copy (one thread,
  or block by block over torch's threads, as promotions run): so the ratio is
  what copying scattered blocks costs, not the choice of stores or threads.
- disk -> host: the disk tier's reads of runs of ``RUN_BLOCKS`` records it
  wrote (NIXL POSIX, each record checked) into host slots, against plain
  sequential reads (``readinto``) of the same files into the same slots. The
  files were just written, so both read from the page cache: this is the
  tier's overhead over a read, not the disk's speed. Two figures: every run
  submitted at once, then waited for (as the engine queues the loads of the
  requests waiting on the tier: the bandwidth the goal is set on), and one
  run at a time, submitted and waited for before the next (each read's
  latency, with a hand-off to the reader thread and back per run).

Trials alternate the two sides; figures are GB/s of block data, medians, and
each ratio is the median of the trials' paired ratios.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import pd_kernels.cpu as cpu_kernels
from pd.engine.tiers.block_store import NixlBlockStore
from pd.engine.tiers.host import HostTier
from pd.engine.tiers.io import NixlRecords
from pd.engine.tiers.store import StoreTier
from router.tiers import Tier

RUN_BLOCKS = 32


def _hashes(num_blocks: int) -> list[bytes]:
    return [index.to_bytes(8, "little") for index in range(num_blocks)]


def host_to_device(block_shape: tuple[int, ...], num_blocks: int, repeats: int = 9) -> dict[str, float]:
    device = torch.randn(num_blocks, *block_shape)
    tier = HostTier(device, num_blocks)
    hashes = _hashes(num_blocks)
    for block_id, block_hash in enumerate(hashes):
        tier.demote(block_id, block_hash, (block_id,))
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    promote_s, memcpy_s = [], []
    for _ in range(repeats):
        tier.reserve(hashes)
        started = time.perf_counter()
        for start in range(0, num_blocks, RUN_BLOCKS):
            tier.promote(hashes[start:start + RUN_BLOCKS], order[start:start + RUN_BLOCKS])
        promote_s.append(time.perf_counter() - started)
        memcpy_s.append(_best_memcpy(tier.cache, device))
    total = device.numel() * device.element_size()
    promote, memcpy = total / statistics.median(promote_s) / 1e9, total / statistics.median(memcpy_s) / 1e9
    return {"host_to_device_gb_per_s": round(promote, 2), "memcpy_gb_per_s": round(memcpy, 2),
            "host_ratio_vs_memcpy": _paired_ratio(memcpy_s, promote_s), "block_bytes": total // num_blocks}


def _best_memcpy(src: torch.Tensor, dst: torch.Tensor) -> float:
    """The fastest copy of the same bytes, in place and in order: torch's ``copy_`` (over its threads),
    or the tier's own streamed copy, as one block (one thread) or block by block in order (over threads)."""
    seconds = []
    for copy in (lambda: dst.copy_(src),
                 lambda: cpu_kernels.copy_blocks(src.view(1, -1), [0], dst.view(1, -1), [0]),
                 lambda: cpu_kernels.copy_blocks(src, list(range(len(src))), dst, list(range(len(dst))))):
        started = time.perf_counter()
        copy()
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def disk_to_host(block_shape: tuple[int, ...], num_blocks: int, block_size: int = 16,
                 repeats: int = 9) -> dict[str, float]:
    device = torch.randn(num_blocks, *block_shape)
    host = HostTier(device, num_blocks)
    data_bytes = device[0].numel() * device.element_size()
    with tempfile.TemporaryDirectory(prefix="pd-kv-tiers-") as path:
        store = NixlBlockStore("bench-disk", "bench", block_size, data_bytes, path=path)
        hashes = _hashes(num_blocks)
        blocks = dict(zip(hashes, device))
        tier = StoreTier(Tier.DISK, NixlRecords(store, host.cache, num_staging=num_blocks), num_blocks, blocks.get)
        tokens = [tuple(range(index, index + block_size)) for index in range(num_blocks)]
        for block_id, block_hash in enumerate(hashes):
            tier.offer(block_hash, tokens[block_id])
        tier.flush()
        tier.poll()
        files = [store.path(block_hash) for block_hash in hashes]
        runs = [[(hashes[i], tokens[i], i) for i in range(start, min(num_blocks, start + RUN_BLOCKS))]
                for start in range(0, num_blocks, RUN_BLOCKS)]
        load_s, one_s, plain_s = [], [], []
        for _ in range(repeats):
            host.cache.zero_()
            load_s.append(_queued_reads(tier, runs))
            assert torch.equal(host.cache, device)
            one_s.append(_one_read_at_a_time(tier, runs))
            plain_s.append(_plain_reads(files, host.cache, store.trailer_bytes))
        tier.close()
    total = num_blocks * data_bytes
    load, plain = total / statistics.median(load_s) / 1e9, total / statistics.median(plain_s) / 1e9
    return {"disk_read_gb_per_s": round(load, 2), "plain_read_gb_per_s": round(plain, 2),
            "disk_ratio_vs_plain": _paired_ratio(plain_s, load_s),
            "disk_ratio_one_run_at_a_time": _paired_ratio(plain_s, one_s)}


def _queued_reads(tier: StoreTier, runs: list[list]) -> float:
    """Every run submitted, then all waited for and checked: the seconds."""
    started = time.perf_counter()
    for ticket, items in enumerate(runs):
        tier.submit_read(ticket, items)
    tier.wait_reads()
    done = {ticket: run for _, ticket, run in tier.finished()}
    elapsed = time.perf_counter() - started
    assert [done[ticket] for ticket in range(len(runs))] == [len(items) for items in runs]
    return elapsed


def _one_read_at_a_time(tier: StoreTier, runs: list[list]) -> float:
    started = time.perf_counter()
    for items in runs:
        assert tier.read_now(items) == len(items)
    return time.perf_counter() - started


def _paired_ratio(reference_s: list[float], ours_s: list[float]) -> float:
    """The median over trials of (reference time / our time): each pair ran back to back, under the same load."""
    return round(statistics.median(ref / ours for ref, ours in zip(reference_s, ours_s)), 3)


def _plain_reads(files: list[Path], slots: torch.Tensor, trailer_bytes: int) -> float:
    """Each whole file read with ``readinto``: its block into its slot (as the tier's reads land), its trailer aside."""
    rows = slots.view(len(files), -1).view(torch.uint8).numpy()
    trailer = bytearray(trailer_bytes)
    started = time.perf_counter()
    for path, row in zip(files, rows):
        with open(path, "rb", buffering=0) as file:
            file.readinto(row)
            file.readinto(trailer)
    return time.perf_counter() - started
