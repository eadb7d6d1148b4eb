"""Reading a range of KV heads between pools of different tensor-parallel splits (NIXL).

Pools are laid out as the engine's (``pd.engine.kv_layout``: heads outermost in
a block), so a range of heads is one descriptor per block and source.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transfer.nixl_api")

from pd.engine.kv_layout import kv_pool  # noqa: E402
from transfer import TransferError, TransferState, create_transport  # noqa: E402
from transfer.base import HeadSlice  # noqa: E402

NUM_BLOCKS, LAYERS, BLOCK_SIZE, HEAD_DIM = 8, 2, 4, 16


def pool(num_heads: int, seed: int | None, head_dim: int = HEAD_DIM) -> torch.Tensor:
    made = kv_pool(NUM_BLOCKS, LAYERS, BLOCK_SIZE, num_heads, head_dim, torch.float32, "cpu")
    if seed is not None:
        made.copy_(torch.randn(made.shape, generator=torch.Generator().manual_seed(seed)))
    return made


@pytest.fixture
def transports():
    made = []

    def make(name: str, kv: torch.Tensor):
        transport = create_transport("nixl", name, timeout_s=5.0)
        made.append(transport)
        transport.register(kv, num_heads=kv.shape[1])
        return transport

    yield make
    for transport in made:
        transport.close()


def test_one_rank_gathers_its_heads_from_two(transports):
    """P(TP=2) -> D(TP=1): each prefill rank's 2 heads land in their half of the decode blocks."""
    sources = [pool(2, seed) for seed in (1, 2)]
    ours = pool(4, None)
    reader = transports("gather-reader", ours)
    owners = [transports(f"gather-owner-{rank}", kv) for rank, kv in enumerate(sources)]
    handles = []
    for rank, owner in enumerate(owners):
        reader.add_peer(owner.local_metadata())
        handles.append(reader.read_blocks(owner.engine_id, [1, 2, 3], [5, 6, 7], notify=f"r{rank}",
                                          heads=HeadSlice(0, 2 * rank, 2)))
    assert [h.wait(5.0) for h in handles] == [TransferState.DONE] * 2
    assert [h.num_descriptors for h in handles] == [3, 3]  # one per block and source
    assert torch.equal(ours[5:8, :2], sources[0][1:4]) and torch.equal(ours[5:8, 2:], sources[1][1:4])
    assert not ours[:5].any() and not ours[8:].any()


def test_two_ranks_each_take_their_half_of_one(transports):
    """P(TP=1) -> D(TP=2): each decode rank reads its 2 of the prefill block's 4 heads."""
    source = pool(4, 3)
    owner = transports("split-owner", source)
    ranks = [pool(2, None) for _ in range(2)]
    for rank, kv in enumerate(ranks):
        reader = transports(f"split-reader-{rank}", kv)
        reader.add_peer(owner.local_metadata())
        handle = reader.read_blocks("split-owner", [0, 1, 2, 6], [4, 5, 6, 7], notify=f"d{rank}",
                                    heads=HeadSlice(2 * rank, 0, 2))
        assert handle.wait(5.0) is TransferState.DONE
        assert torch.equal(kv[4:], source[[0, 1, 2, 6], 2 * rank:2 * rank + 2])


def test_whole_blocks_of_equal_splits_move_as_before(transports):
    source = pool(2, 4)
    ours = pool(2, None)
    reader, owner = transports("whole-reader", ours), transports("whole-owner", source)
    reader.add_peer(owner.local_metadata())
    handle = reader.read_blocks("whole-owner", [2, 3, 4], [0, 1, 2], notify="w", heads=HeadSlice(0, 0, 2))
    assert handle.wait(5.0) is TransferState.DONE and handle.num_descriptors == 1  # one run
    assert torch.equal(ours[:3], source[2:5])


def test_head_ranges_that_cannot_be_bridged_are_refused_before_any_byte_moves(transports):
    ours = pool(2, None)
    reader = transports("refuse-reader", ours)
    wide = transports("refuse-wide", pool(2, 5, head_dim=2 * HEAD_DIM))
    four = transports("refuse-four", pool(4, 6))
    reader.add_peer(wide.local_metadata())
    reader.add_peer(four.local_metadata())
    with pytest.raises(TransferError, match="has 2048-byte heads, ours are 1024"):
        reader.read_blocks("refuse-wide", [0], [0], notify="x", heads=HeadSlice(0, 0, 1))
    with pytest.raises(TransferError, match=r"head range \(3, 0, 2\) is outside peer 'refuse-four''s 4 heads"):
        reader.read_blocks("refuse-four", [0], [0], notify="x", heads=HeadSlice(3, 0, 2))
    with pytest.raises(TransferError, match=r"head range \(0, 1, 2\) is outside"):
        reader.read_blocks("refuse-four", [0], [0], notify="x", heads=HeadSlice(0, 1, 2))
    with pytest.raises(TransferError, match="has 4096-byte blocks, ours are 2048"):
        reader.read_blocks("refuse-four", [0], [0], notify="x")  # whole blocks of another split
    assert not ours.any()
