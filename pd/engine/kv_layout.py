"""The KV pool's layout: block-major, and within a block, heads outermost.

    pool:  [num_blocks, num_kv_heads, num_layers, planes, block_size, head_dim]

``planes`` is 2 (K, V) for grouped-query attention. Multi-head latent
attention (``pd.model.mla``) keeps one plane of one "head" whose row is the
token's latent and rotary key (``ModelConfig.kv_head_dim``, 576 values for
DeepSeek-V3): a block is then ``[num_layers, block_size, latent_dim]``, one
contiguous range like any other, so transfer, tiers and hashing move it as
they move a GQA block, and tensor-parallel ranks replicate its one head.

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

from pd.model.config import ModelConfig
from pd.model.tp import TPShard
from pd_kernels.fp8 import FP8_NAMES

# Named in the layout fingerprint: pools of other layouts never exchange bytes.
BLOCK_LAYOUT = "heads-outer"


def kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: the model's ``dtype`` for ``"auto"``, else the FP8 format named."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in FP8_NAMES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(FP8_NAMES)}, got {kv_cache_dtype!r}")
    return FP8_NAMES[kv_cache_dtype]


def kv_pool(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, device: torch.device | str, planes: int = 2) -> torch.Tensor:
    """A zeroed pool (``device="meta"``: its shape only); in host memory, on huge pages where the OS lends them."""
    shape = (num_blocks, num_kv_heads, num_layers, planes, block_size, head_dim)
    kind = torch.device(device).type
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pool = torch.empty(shape, dtype=dtype)
    advise_huge_pages(pool)
    return pool.zero_()  # the first touch: the pages are faulted in huge where the advice took


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor`` with transparent huge pages (``madvise``); whether the call was taken.

    Attention reads a sequence's blocks from all over the pool, a jump to another 4 KiB page (and a TLB
    miss) every block; with 2 MiB pages the TLB covers the pool. A no-op where the OS says no.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    huge = 1 << 21
    start = tensor.data_ptr()
    first, last = (start + huge - 1) & ~(huge - 1), (start + tensor.numel() * tensor.element_size()) & ~(huge - 1)
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    madv_hugepage = 14
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), madv_hugepage) == 0


def layer_views(pool: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's planes, ``[num_blocks, block_size, num_kv_heads, head_dim]`` strided views of ``pool``:
    ``(k, v)``, or MLA's ``(latent,)``."""
    return [tuple(pool[:, :, layer, plane].transpose(1, 2) for plane in range(pool.shape[3]))
            for layer in range(pool.shape[2])]


def pool_blocks(pool: torch.Tensor) -> int:
    """The blocks a pool holds."""
    return pool.shape[0]


def pool_heads(pool: torch.Tensor) -> int:
    """The KV heads a pool's blocks hold (each one contiguous slice of its block)."""
    return pool.shape[1]


def block_shape(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, planes: int = 2) -> tuple[int, ...]:
    """One block's shape in the pool."""
    return (num_kv_heads, num_layers, planes, block_size, head_dim)


def model_pool(model: ModelConfig, num_blocks: int, block_size: int, num_kv_heads: int, dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
    """``kv_pool`` in ``model``'s layout (its planes and row width), holding ``num_kv_heads`` heads (a rank's)."""
    return kv_pool(num_blocks, model.num_layers, block_size, num_kv_heads, model.kv_head_dim, dtype, device,
                   planes=model.kv_planes)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes one block takes in the block-major pool (all layers and planes); one rank's pool with TP."""
    num_kv_heads = TPShard(0, tensor_parallel_size).local_config(model).num_kv_heads
    return model.num_layers * model.kv_planes * block_size * num_kv_heads * model.kv_head_dim * dtype.itemsize
