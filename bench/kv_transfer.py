"""KV transfer benchmark: ``python -m bench.kv_transfer --backend nixl|torch``.

Moves the KV of one 2048-token prompt of the Qwen2.5-0.5B shape (24 layers
x K/V x 2 KV heads x 64 dim x fp32, 128 blocks of 16 tokens, 48 MiB) from a
prefill process's pool into this (decode) process's pool, through our
transport, with the block lists two pools' allocators hand out after some
churn (mostly consecutive runs with gaps).

Every round times, back to back on the same machine:
- ``ours``: ``read_blocks`` of those lists, until the handle is DONE;
- ``raw``: raw NIXL, the same number of bytes as one descriptor (a READ
  prepared once and reposted), the transfer library's own ceiling;
- ``memcpy``: one single-threaded copy of as many bytes between two
  pre-touched buffers, the machine's ceiling;
- ``one_run``: our transport again, all 128 blocks as one run.
Each figure is the median over rounds; each ratio is the median of the
per-round ratios, so slow moments of a shared machine cancel out. A final
read into sentinel-filled blocks checks the contents (``verified``).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import multiprocessing
import random
import time

import torch

from pd.workload.stats import percentile

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 24, 2, 64, 16
PROMPT_TOKENS = 2048
NUM_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE  # 128
POOL_BLOCKS = 512
BLOCK_SHAPE = (NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
TRANSFER_BYTES = NUM_BLOCKS * BLOCK_BYTES  # 48 MiB
CHURN_STEPS = 80
WAIT_S = 30.0
SENTINEL = -1  # no pattern word is negative


def quiet_nixl() -> None:
    """NIXL logs INFO lines to stdout, which must carry only the JSON result."""
    import transfer.nixl_api  # noqa: F401  (NIXL's import configures the "nixl" logger)

    logging.getLogger("nixl").setLevel(logging.WARNING)


def allocator_block_ids(seed: int) -> list[int]:
    """The blocks a ``BlockPool`` of ``POOL_BLOCKS`` hands a 2048-token prompt after some churn."""
    from pd.engine.block_pool import BlockPool

    pool, rng, live = BlockPool(POOL_BLOCKS), random.Random(seed), []
    for _ in range(CHURN_STEPS):
        if live and (rng.random() < 0.45 or pool.num_free_blocks < 64):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.allocate(rng.randint(4, 64)))
    while pool.num_free_blocks < NUM_BLOCKS:
        pool.free(live.pop(rng.randrange(len(live))))
    return pool.allocate(NUM_BLOCKS)


def new_pool(patterned: bool) -> torch.Tensor:
    """``[POOL_BLOCKS, layers, 2, block_size, kv_heads, head_dim]`` fp32; block b's words are ``b * 2^20 + i``."""
    pool = torch.empty(POOL_BLOCKS, *BLOCK_SHAPE, dtype=torch.float32)
    words = pool.view(POOL_BLOCKS, -1).view(torch.int32)  # [POOL_BLOCKS, block words]
    if patterned:
        words.copy_(block_words(torch.arange(POOL_BLOCKS)))
    else:
        words.fill_(SENTINEL)
    return pool


def block_words(block_ids: torch.Tensor) -> torch.Tensor:
    offsets = torch.arange(BLOCK_BYTES // 4, dtype=torch.int32)
    return block_ids.to(torch.int32)[:, None] * (1 << 20) + offsets[None, :]


def _prefill_main(conn, backend: str) -> None:
    """The owner: serves our transport's control messages, and a raw NIXL agent over the same pool."""
    from transfer import create_transport
    from transfer.nixl_api import make_agent

    quiet_nixl()
    torch.set_num_threads(1)
    pool = new_pool(patterned=True)
    options = {"role": "prefill"} if backend == "torch" else {}
    transport = create_transport(backend, "bench-prefill", **options)
    transport.register(pool)
    raw = make_agent("bench-raw-prefill", ["UCX"])
    raw_descs = raw.register_memory(pool)
    conn.send((transport.local_metadata(), raw.get_agent_metadata(), pool.data_ptr()))
    notifications = []
    try:
        while True:
            if not conn.poll(0.001):
                notifications += transport.poll_notifications()
                continue
            command, payload = conn.recv()
            if command == "control":
                conn.send(transport.handle_control(payload))
            elif command == "notifications":
                notifications += transport.poll_notifications()
                conn.send(notifications)
            else:
                break
    finally:
        transport.close()
        raw.deregister_memory(raw_descs)


class RawNixl:
    """One READ of ``TRANSFER_BYTES`` as a single descriptor, prepared once and reposted."""

    def __init__(self, pool: torch.Tensor, peer_metadata: bytes, peer_address: int):
        from transfer.nixl_api import make_agent

        self.agent = make_agent("bench-raw-decode", ["UCX"])
        self.descs = self.agent.register_memory(pool)
        peer = self.agent.add_remote_agent(peer_metadata)
        self.peer = peer.decode() if isinstance(peer, bytes) else peer
        local = self.agent.get_xfer_descs([(pool.data_ptr(), TRANSFER_BYTES, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(peer_address, TRANSFER_BYTES, 0)], "DRAM")
        self.xfer = self.agent.initialize_xfer("READ", local, remote, self.peer)

    def read(self) -> float:
        start = time.perf_counter()
        status = self.agent.transfer(self.xfer)
        while status == "PROC":
            status = self.agent.check_xfer_state(self.xfer)
        if status != "DONE":
            raise RuntimeError(f"raw NIXL read ended {status}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.xfer.release()
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.descs)


def timed_read(transport, remote_ids: list[int], local_ids: list[int], notify: str) -> float:
    from transfer import TransferState

    start = time.perf_counter()
    handle = transport.read_blocks("bench-prefill", remote_ids, local_ids, notify=notify)
    while (state := handle.poll()) is TransferState.PENDING:  # spins, as the raw baseline does
        if time.perf_counter() - start > WAIT_S:
            break
    elapsed = time.perf_counter() - start
    if state is not TransferState.DONE:
        raise RuntimeError(f"read {notify} ended {state.value}: {handle.error}")
    return elapsed


def timed_memcpy(dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), TRANSFER_BYTES)
    return time.perf_counter() - start


def time_rounds(transport, raw: RawNixl, remote_ids: list[int], local_ids: list[int], warmup: int,
                rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each way to move the blocks, interleaved so that they share the machine's state."""
    src = torch.ones(TRANSFER_BYTES, dtype=torch.uint8)
    dst = torch.ones(TRANSFER_BYTES, dtype=torch.uint8)
    contiguous = list(range(NUM_BLOCKS))
    times: dict[str, list[float]] = {"ours": [], "raw": [], "memcpy": [], "one_run": []}
    for i in range(warmup + rounds):
        sample = {
            "ours": timed_read(transport, remote_ids, local_ids, f"bench-{i}"),
            "raw": raw.read(),
            "memcpy": timed_memcpy(dst, src),
            "one_run": timed_read(transport, contiguous, contiguous, f"bench-run-{i}"),
        }
        if i >= warmup:
            for name, seconds in sample.items():
                times[name].append(seconds)
    return times


def verify_read(transport, pool: torch.Tensor, remote_ids: list[int], local_ids: list[int]) -> bool:
    """Whether one more read lands each remote block's pattern in its local block and touches no other."""
    pool.view(POOL_BLOCKS, -1).view(torch.int32).fill_(SENTINEL)
    timed_read(transport, remote_ids, local_ids, "bench-verify")
    words = pool.view(POOL_BLOCKS, -1).view(torch.int32)
    verified = torch.equal(words[local_ids], block_words(torch.tensor(remote_ids)))
    untouched = sorted(set(range(POOL_BLOCKS)) - set(local_ids))
    return verified and bool((words[untouched] == SENTINEL).all())


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    """Median bandwidths, and the median over rounds of a baseline's time over ours (above 1: ours is faster)."""

    def gb_per_s(name: str) -> float:
        return round(TRANSFER_BYTES / percentile(times[name], 50) / 1e9, 3)

    def ratio(name: str) -> float:
        return round(percentile([t / o for t, o in zip(times[name], times["ours"])], 50), 3)

    return {
        "gb_per_s": gb_per_s("ours"),
        "raw_nixl_gb_per_s": gb_per_s("raw"),
        "memcpy_gb_per_s": gb_per_s("memcpy"),
        "one_run_gb_per_s": gb_per_s("one_run"),
        "ratio_vs_raw": ratio("raw"),
        "ratio_vs_memcpy": ratio("memcpy"),
    }


def run(backend: str, rounds: int, warmup: int) -> dict:
    from transfer import block_runs, create_transport

    quiet_nixl()
    torch.set_num_threads(1)
    remote_ids, local_ids = allocator_block_ids(seed=1), allocator_block_ids(seed=2)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_prefill_main, args=(child, backend), daemon=True)
    process.start()
    transport = raw = None
    try:
        if not conn.poll(120):
            raise RuntimeError("the prefill process did not start")
        metadata, raw_metadata, peer_address = conn.recv()

        def control(peer: str, message: bytes) -> bytes:
            conn.send(("control", message))
            return conn.recv()

        pool = new_pool(patterned=False)
        options = {"role": "decode", "control": control} if backend == "torch" else {}
        transport = create_transport(backend, "bench-decode", **options)
        transport.register(pool)
        transport.add_peer(metadata)
        raw = RawNixl(pool, raw_metadata, peer_address)
        times = time_rounds(transport, raw, remote_ids, local_ids, warmup, rounds)
        verified = verify_read(transport, pool, remote_ids, local_ids)

        expected = 2 * (warmup + rounds) + 1
        deadline, notified = time.monotonic() + 5, []
        while len(notified) < expected and time.monotonic() < deadline:
            conn.send(("notifications", None))
            notified = conn.recv()
    finally:
        if transport is not None:
            transport.close()
        if raw is not None:
            raw.close()
        try:
            conn.send(("stop", None))
        except OSError:
            pass
        process.join(10)
        if process.is_alive():
            process.kill()

    return {
        "backend": backend,
        "bytes": TRANSFER_BYTES,
        "blocks": NUM_BLOCKS,
        "descriptors": len(block_runs(remote_ids, local_ids)),
        "rounds": rounds,
        **summarize(times),
        "verified": verified,
        "notified": len(notified) == expected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("nixl", "torch"), default="nixl")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.backend, args.rounds, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
