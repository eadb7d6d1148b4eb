"""Where a replica holds a cached block, and what a prefix hit there is worth. Pure Python, no Ray.

A hit in a slower tier still saves recomputing the block, but the block must
be loaded first. Its value is the fraction of a device hit it is worth:

    value(tier) = max(0, 1 - load_s(tier) / recompute_s)        per block

The defaults are derived for one reference deployment (``DEFAULT_HIT_VALUES``;
set the policies' ``*_hit_value`` fields for another):

- The model: Llama-3-8B in bf16, blocks of 16 tokens. One token's KV is
  32 layers x 2 (K and V) x 8 KV heads x 128 x 2 bytes = 128 KiB, so a block
  is 2 MiB.
- Recomputing a block on an H100 that sustains 4e14 FLOP/s in prefill (40% of
  its 989e12 dense bf16 peak; about 25k prompt tokens/s): the dense layers
  take 16 x 2 x 8e9 / 4e14 = 0.64 ms; attention over a 4k-token prefix adds
  16 x (4 x 32 layers x 32 heads x 128 x 4096) / (989e12 x 0.3) = 0.11 ms.
  ``RECOMPUTE_S`` = 0.75 ms. Shorter prefixes make recomputing cheaper and
  every slower tier worth less; longer ones, the opposite.
- Loads are batched: a prompt's blocks in one tier are fetched together, as
  many requests in flight, so per-request latency (tens of microseconds over
  PCIe, about 0.1 ms from NVMe, a millisecond or more from a networked
  store) is paid once per prompt, not per block, and is left out. A tier
  is charged its bandwidth only. Loads are not credited for overlapping
  compute: the engine's host tier copies synchronously today.

    tier     bandwidth per GPU, reads batched                        load of 2 MiB   value
    device   none needed                                             0               1.0
    host     50 GB/s: pinned memory over PCIe Gen5 x16               0.042 ms        0.94
    disk     10 GB/s: local NVMe through GPUDirect Storage, a        0.21 ms         0.72
             node's 8 drives (~50 GB/s) shared by its 8 GPUs, with
             some of a neighbour's share when it is idle
    shared   5 GB/s: a networked store read with many parallel       0.42 ms         0.44
             requests per prompt, over a 400 Gb/s NIC that also
             carries prefill-to-decode KV transfers

A store read one request at a time (an S3-like 1 GB/s) would take 2.1 ms
per block, more than recomputing it: its hits are worth 0. That is what
the batching assumption buys; a deployment whose shared store cannot read
in parallel should set ``shared_hit_value`` to 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class Tier(enum.IntEnum):
    """Where a replica holds a cached block, fastest first: the one enum of the engine's tiers, its
    block pool's cache events and the routers' index (the engine imports it; the router never imports the engine).

    ``SHARED`` is the deployment's shared store, which every replica can read.
    """

    DEVICE = 0
    HOST = 1
    DISK = 2
    SHARED = 3


def hit_value(load_s: float, recompute_s: float) -> float:
    """The fraction of a device hit that a hit costing ``load_s`` to load is worth."""
    return max(0.0, 1.0 - load_s / recompute_s)


# The reference deployment of the module docstring.
BLOCK_BYTES = 16 * 32 * 2 * 8 * 128 * 2  # tokens x layers x (K, V) x KV heads x head dim x bf16 bytes: 2 MiB
RECOMPUTE_S = 0.75e-3
LOAD_BYTES_PER_S = {Tier.HOST: 50e9, Tier.DISK: 10e9, Tier.SHARED: 5e9}
DEFAULT_HIT_VALUES = {Tier.DEVICE: 1.0} | {
    tier: round(hit_value(BLOCK_BYTES / bandwidth, RECOMPUTE_S), 2) for tier, bandwidth in LOAD_BYTES_PER_S.items()
}


@dataclass(frozen=True, kw_only=True)
class TierHitValues:
    """What a hit in each tier is worth, as a fraction of a device hit (module docstring); a policy config's part."""

    host_hit_value: float = DEFAULT_HIT_VALUES[Tier.HOST]
    disk_hit_value: float = DEFAULT_HIT_VALUES[Tier.DISK]
    shared_hit_value: float = DEFAULT_HIT_VALUES[Tier.SHARED]

    def __post_init__(self) -> None:
        for name in ("host_hit_value", "disk_hit_value", "shared_hit_value"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def hit_values(self) -> tuple[float, ...]:
        """Each tier's value, indexed by ``Tier``."""
        return 1.0, self.host_hit_value, self.disk_hit_value, self.shared_hit_value


def matched_tokens(num_matched_blocks: int, block_size: int, num_prompt_tokens: int) -> int:
    """Prompt tokens a replica can reuse. The last prompt token is always computed, to sample from."""
    return max(0, min(num_matched_blocks * block_size, num_prompt_tokens - 1))


def valued_tokens(run: int | Sequence[int], hit_values: Sequence[float], block_size: int,
                  num_prompt_tokens: int) -> tuple[int, float]:
    """``(matched, valued)`` tokens of a replica's leading run of a prompt's blocks.

    ``run`` is the run's length, all on the device (``PrefixIndex.match``),
    or the tier of each of its blocks (``PrefixIndex.match_tiers``).
    ``matched`` is ``matched_tokens``; ``valued`` weighs each matched token by
    its block's tier (``TierHitValues.hit_values``). A device-only run's
    ``valued`` equals ``matched`` exactly.
    """
    if not isinstance(run, int) and run.count(Tier.DEVICE) == len(run):  # the common case, in C
        run = len(run)
    if isinstance(run, int):
        matched = matched_tokens(run, block_size, num_prompt_tokens)
        return matched, float(matched)
    matched = matched_tokens(len(run), block_size, num_prompt_tokens)
    if not matched:
        return 0, 0.0
    num_blocks = -(-matched // block_size)  # the blocks holding matched tokens; the last may hold fewer
    cut = num_blocks * block_size - matched  # tokens of the last block that are computed anyway
    valued = block_size * sum(map(hit_values.__getitem__, run[:num_blocks])) - hit_values[run[num_blocks - 1]] * cut
    return matched, valued
