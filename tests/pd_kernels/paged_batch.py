"""Random paged attention batches for the kernel tests.

The caches are strided views of one layer of a pool laid out as the engine's
(``pd.engine.kv_layout``: ``[num_blocks, num_kv_heads, num_layers, 2,
block_size, head_dim]``), and each sequence's pages sit at random blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd.engine.kv_layout import layer_views

NUM_LAYERS = 2
LAYER = 1


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    pool: torch.Tensor  # [num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    live: torch.Tensor  # bool [num_blocks, block_size]: slots holding some sequence's keys

    @property
    def k_cache(self) -> torch.Tensor:
        return layer_views(self.pool)[LAYER][0]

    @property
    def v_cache(self) -> torch.Tensor:
        return layer_views(self.pool)[LAYER][1]

    def args(self, pool: torch.Tensor | None = None) -> tuple:
        k_cache, v_cache = layer_views(self.pool if pool is None else pool)[LAYER]
        return (self.q, k_cache, v_cache, self.cu_seqlens_q, self.seq_lens, self.block_table)

    def poisoned_pool(self) -> torch.Tensor:
        """The pool with NaN in every slot but the live ones of this layer.

        A kernel that reads a key it must not see (past seq_len, in a padding
        entry of the block table, in another layer) turns its output into NaN.
        """
        poisoned = torch.full_like(self.pool, float("nan"))
        num_kv_heads = self.pool.shape[1]
        live = self.live[:, None, None, :].expand(-1, num_kv_heads, 2, -1)  # [num_blocks, heads, k/v, block_size]
        poisoned[:, :, LAYER][live] = self.pool[:, :, LAYER][live]
        return poisoned


def make_batch(
    q_kv_lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """A batch where sequence i has ``q_len, kv_len = q_kv_lens[i]``; the pool of ``kv_dtype``
    (``dtype`` when None), its values cast to it."""
    generator = torch.Generator().manual_seed(seed)
    q_lens = [q_len for q_len, _ in q_kv_lens]
    seq_lens = [kv_len for _, kv_len in q_kv_lens]
    num_pages = [-(-kv_len // block_size) for kv_len in seq_lens]
    max_pages = max(num_pages)
    num_blocks = sum(num_pages) + 3  # a few blocks nobody owns
    pool = torch.randn(num_blocks, num_kv_heads, NUM_LAYERS, 2, block_size, head_dim, generator=generator,
                       device="cpu").to(kv_dtype or dtype)
    # Padding entries of the table point at random blocks; kernels must not read them.
    block_table = torch.randint(0, num_blocks, (len(q_kv_lens), max_pages), generator=generator, dtype=torch.int32,
                                device="cpu")
    live = torch.zeros(num_blocks, block_size, dtype=torch.bool, device="cpu")
    block_ids = torch.randperm(num_blocks, generator=generator, device="cpu").to(torch.int32)
    start = 0
    for i, (kv_len, pages) in enumerate(zip(seq_lens, num_pages)):
        block_table[i, :pages] = block_ids[start : start + pages]
        start += pages
        positions = torch.arange(kv_len, device="cpu")
        live[block_table[i, positions // block_size].long(), positions % block_size] = True
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator, device="cpu").to(dtype)
    cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cpu")
    cu_seqlens_q[1:] = torch.tensor(q_lens, device="cpu").cumsum(0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cpu")
    # Built on the CPU (the generator is a CPU one), then moved to the tests' device.
    device = torch.get_default_device()
    return PagedBatch(*(t.to(device) for t in (q, pool, cu_seqlens_q, seq_lens_t, block_table, live)))
