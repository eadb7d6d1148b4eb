"""KV transfer between pools of different tensor-parallel splits: ``python -m bench.tp_transfer``.

The KV of one 2048-token prompt of ``bench.kv_transfer``'s shape (24 layers,
2 KV heads of 64, fp32, 128 blocks of 16 tokens, 48 MiB in all), laid out as
the engine lays out its pool (``pd.engine.kv_layout``: heads outermost in a
block). A prefill process holds the pools of two splits: TP=2 (two ranks of
one head each, each its own NIXL agent) and TP=1 (both heads). This process
is one decode rank, and reads, through ``read_blocks(..., heads=...)``:

- ``2to1``: a TP=1 decode rank gathers its 2 heads, one from each prefill rank;
- ``1to2``: a TP=2 decode rank takes its 1 head of the TP=1 prefill blocks.

Block lists are the allocator's after churn, as in ``bench.kv_transfer``. Each
round times ours against raw NIXL moving the same bytes, one descriptor per
source rank (a READ prepared once and reposted): the ceiling. Prints one JSON
line per case, with the descriptors ours posted against the goal's bound
(2 x blocks x source ranks read from), medians and the median of per-round
ratios, and whether the bytes landed where they belong.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

import torch

from bench.kv_transfer import BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS, NUM_LAYERS, POOL_BLOCKS, allocator_block_ids, quiet_nixl
from pd.workload.host import cpu_name
from pd.workload.stats import percentile

HEAD_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * 4
WAIT_S = 30.0


def new_pool(num_heads: int, seed: int | None) -> torch.Tensor:
    from pd.engine.kv_layout import kv_pool

    pool = kv_pool(POOL_BLOCKS, NUM_LAYERS, BLOCK_SIZE, num_heads, HEAD_DIM, torch.float32, "cpu")
    if seed is not None:
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def _prefill_main(conn) -> None:
    """TP=2 ranks (one head each) and a TP=1 pool (two heads), each behind its own NIXL agent, plus raw agents."""
    from transfer import create_transport
    from transfer.nixl_api import make_agent

    quiet_nixl()
    torch.set_num_threads(1)
    pools = {"rank0": new_pool(1, 1), "rank1": new_pool(1, 2), "whole": new_pool(2, 3)}
    transports, raws, described = {}, {}, {}
    for name, pool in pools.items():
        transports[name] = create_transport("nixl", f"bench-{name}")
        transports[name].register(pool, num_heads=pool.shape[1])
        raws[name] = make_agent(f"bench-raw-{name}", ["UCX"])
        raws[name].register_memory(pool)
        described[name] = (transports[name].local_metadata(), raws[name].get_agent_metadata(), pool.data_ptr())
    conn.send(described)
    try:
        conn.recv()  # stop
    finally:
        for transport in transports.values():
            transport.close()


class RawReads:
    """Raw NIXL: one descriptor of ``num_bytes`` from each source, posted together, prepared once."""

    def __init__(self, name: str, pool: torch.Tensor, sources: list[tuple[bytes, int]], num_bytes: int):
        from transfer.nixl_api import make_agent

        self.agent = make_agent(name, ["UCX"])
        self.agent.register_memory(pool)
        self.xfers = []
        for index, (metadata, address) in enumerate(sources):
            peer = self.agent.add_remote_agent(metadata)
            peer = peer.decode() if isinstance(peer, bytes) else peer
            local = self.agent.get_xfer_descs([(pool.data_ptr() + index * num_bytes, num_bytes, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(address, num_bytes, 0)], "DRAM")
            self.xfers.append(self.agent.initialize_xfer("READ", local, remote, peer))

    def read(self) -> float:
        start = time.perf_counter()
        pending = [xfer for xfer in self.xfers if self.agent.transfer(xfer) == "PROC"]
        while pending:
            pending = [xfer for xfer in pending if self.agent.check_xfer_state(xfer) == "PROC"]
        return time.perf_counter() - start


def timed_heads(transport, reads: list[tuple[str, object]], remote_ids, local_ids) -> tuple[float, int]:
    """All ``(peer, HeadSlice)`` reads posted together, until every one is DONE: seconds, descriptors."""
    from transfer import TransferState

    start = time.perf_counter()
    handles = [transport.read_blocks(peer, remote_ids, local_ids, notify="", heads=heads) for peer, heads in reads]
    for handle in handles:
        while (state := handle.poll()) is TransferState.PENDING:
            if time.perf_counter() - start > WAIT_S:
                break
        if state is not TransferState.DONE:
            raise RuntimeError(f"a head read ended {state.value}: {handle.error}")
    return time.perf_counter() - start, sum(handle.num_descriptors for handle in handles)


def run_case(case: str, described: dict, rounds: int, warmup: int) -> dict:
    from transfer import create_transport
    from transfer.base import HeadSlice

    remote_ids, local_ids = allocator_block_ids(seed=1), allocator_block_ids(seed=2)
    if case == "2to1":
        pool, sources = new_pool(2, None), ["rank0", "rank1"]
        reads = [("bench-rank0", HeadSlice(0, 0, 1)), ("bench-rank1", HeadSlice(0, 1, 1))]
    else:
        pool, sources = new_pool(1, None), ["whole"]
        reads = [("bench-whole", HeadSlice(1, 0, 1))]  # decode rank 1 of 2: the second head
    moved = NUM_BLOCKS * HEAD_BYTES * len(reads)
    transport = create_transport("nixl", f"bench-decode-{case}")
    transport.register(pool, num_heads=pool.shape[1])
    for name in sources:
        transport.add_peer(described[name][0])
    raw_pool = torch.zeros(moved // 4, dtype=torch.float32)
    raw = RawReads(f"bench-raw-decode-{case}", raw_pool, [(described[n][1], described[n][2]) for n in sources],
                   moved // len(sources))
    ours_s, raw_s, descriptors = [], [], 0
    try:
        for i in range(warmup + rounds):
            seconds, descriptors = timed_heads(transport, reads, remote_ids, local_ids)
            raw_seconds = raw.read()
            if i >= warmup:
                ours_s.append(seconds)
                raw_s.append(raw_seconds)
        verified = _verify(case, pool, remote_ids, local_ids)
    finally:
        transport.close()
    return {
        "bench": "tp_transfer", "case": case, "cpu": cpu_name(), "blocks": NUM_BLOCKS, "bytes": moved,
        "source_ranks": len(sources), "descriptors": descriptors,
        "descriptor_bound": 2 * NUM_BLOCKS * len(sources),
        "gb_per_s": round(moved / percentile(ours_s, 50) / 1e9, 3),
        "raw_nixl_gb_per_s": round(moved / percentile(raw_s, 50) / 1e9, 3),
        "ratio_vs_raw": round(percentile([r / o for r, o in zip(raw_s, ours_s)], 50), 3),
        "rounds": rounds, "verified": verified,
    }


def _verify(case: str, pool: torch.Tensor, remote_ids: list[int], local_ids: list[int]) -> bool:
    """The prefill pools are seeded: rebuild them here and compare the heads that landed."""
    if case == "2to1":
        expected = torch.cat([new_pool(1, 1)[remote_ids], new_pool(1, 2)[remote_ids]], dim=1)
    else:
        expected = new_pool(2, 3)[remote_ids][:, 1:2]
    untouched = sorted(set(range(POOL_BLOCKS)) - set(local_ids))
    return torch.equal(pool[local_ids], expected) and not pool[untouched].any()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cases", default="2to1,1to2")
    args = parser.parse_args()
    quiet_nixl()
    torch.set_num_threads(1)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_prefill_main, args=(child,), daemon=True)
    process.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("the prefill process did not start")
        described = conn.recv()
        for case in args.cases.split(","):
            print(json.dumps(run_case(case, described, args.rounds, args.warmup)), flush=True)
    finally:
        conn.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


if __name__ == "__main__":
    main()
