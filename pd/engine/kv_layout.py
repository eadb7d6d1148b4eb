"""The KV pool's layout: block-major, and within a block, heads outermost.

    pool:  [num_blocks, num_kv_heads, num_layers, 2 (K, V), block_size, head_dim]

Each block is one contiguous byte range (a run of block ids is one range), so
whole blocks move between pools, tiers and peers as they are. Within a block
each KV head holds its K and V of every layer back to back, so any range of
heads is one contiguous range of the block too: a peer whose tensor-parallel
split differs reads the heads it owns with one descriptor per block and
source rank, where a heads-innermost block would need one per layer, K/V and
token. The cost: a token's heads are not adjacent, so the KV store writes one
``head_dim`` row per head instead of one per token (attention reads a head's
tokens back to back, which it prefers).

The attention kernels take per-layer views ``[num_blocks, block_size,
num_kv_heads, head_dim]`` with these strides (head_dim contiguous).
"""

from __future__ import annotations

import torch

# Named in the layout fingerprint: pools of other layouts never exchange bytes.
BLOCK_LAYOUT = "heads-outer"


def kv_pool(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed pool (``device="meta"``: its shape only)."""
    shape = (num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim)
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_views(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(k, v)``, ``[num_blocks, block_size, num_kv_heads, head_dim]`` strided views of ``pool``."""
    return [(pool[:, :, layer, 0].transpose(1, 2), pool[:, :, layer, 1].transpose(1, 2))
            for layer in range(pool.shape[2])]


def pool_heads(pool: torch.Tensor) -> int:
    """The KV heads a pool's blocks hold (each one contiguous slice of its block)."""
    return pool.shape[1]


def block_shape(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One block's shape in the pool."""
    return (num_kv_heads, num_layers, 2, block_size, head_dim)
