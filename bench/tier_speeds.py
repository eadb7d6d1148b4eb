"""How fast the KV tiers move blocks, against the physical copy each stands on, measured in the same run.

- host -> device: ``HostTier.promote`` of runs of ``RUN_BLOCKS`` blocks (a
  prompt's worth) into device blocks in a shuffled order, as an allocator
  hands them out; against one copy of the same bytes as a single tensor, the
  faster of torch's ``copy_`` and the tier's own streamed copy (so the ratio
  is what copying scattered blocks costs, not the choice of stores).
- disk -> host: ``StoreTier.load`` of runs of ``RUN_BLOCKS`` records written
  by the disk tier (NIXL POSIX, each record checked) into host slots;
  against plain sequential reads (``readinto``) of the same files into the
  same slots. The files
  were just written, so both read from the page cache: this is the tier's
  overhead over a read, not the disk's speed.

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

import kernels.cpu as cpu_kernels
from pd.engine.block_pool import Tier
from pd.engine.block_store import NixlBlockStore
from pd.engine.host_tier import HostTier
from pd.engine.store_tier import StoreTier

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
    """The faster of torch's ``copy_`` and the tier's own streamed copy, of all the bytes as one block."""
    started = time.perf_counter()
    dst.copy_(src)
    plain = time.perf_counter() - started
    started = time.perf_counter()
    cpu_kernels.copy_blocks(src.view(1, -1), [0], dst.view(1, -1), [0])
    return min(plain, time.perf_counter() - started)


def disk_to_host(block_shape: tuple[int, ...], num_blocks: int, block_size: int = 16,
                 repeats: int = 9) -> dict[str, float]:
    device = torch.randn(num_blocks, *block_shape)
    host = HostTier(device, num_blocks)
    data_bytes = device[0].numel() * device.element_size()
    with tempfile.TemporaryDirectory(prefix="pd-kv-tiers-") as path:
        store = NixlBlockStore("bench-disk", "bench", block_size, data_bytes, path=path)
        hashes = _hashes(num_blocks)
        blocks = dict(zip(hashes, device))
        tier = StoreTier(Tier.DISK, store, num_blocks, host.cache, blocks.get, num_staging=num_blocks)
        tokens = [tuple(range(index, index + block_size)) for index in range(num_blocks)]
        for block_id, block_hash in enumerate(hashes):
            tier.offer(block_hash, tokens[block_id])
        tier.flush()
        tier.poll()
        files = [store.path(block_hash) for block_hash in hashes]
        load_s, plain_s = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            for start in range(0, num_blocks, RUN_BLOCKS):
                items = [(hashes[i], tokens[i], i) for i in range(start, min(num_blocks, start + RUN_BLOCKS))]
                assert tier.read_now(items) == len(items)
            load_s.append(time.perf_counter() - started)
            plain_s.append(_plain_reads(files, host.cache, store.trailer_bytes))
        assert torch.equal(host.cache, device)
        tier.close()
    total = num_blocks * data_bytes
    load, plain = total / statistics.median(load_s) / 1e9, total / statistics.median(plain_s) / 1e9
    return {"disk_read_gb_per_s": round(load, 2), "plain_read_gb_per_s": round(plain, 2),
            "disk_ratio_vs_plain": _paired_ratio(plain_s, load_s)}


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
