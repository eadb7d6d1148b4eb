"""A pull aborted while its bytes are still arriving never writes into blocks someone else owns.

The prefill peer is slow on purpose: a torch peer pauses before each run it
sends; a NIXL peer (UCX over TCP, where a READ needs the target's progress)
is stopped outright. The decode engine aborts the request mid-transfer, the
allocator hands every free block to "another request", which fills them
with a sentinel, and the peer then finishes. Not one sentinel byte may change,
and the aborted pull's blocks come back to the pool once the read is over.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.transfer.test_engine_pairs import GREEDY, PROMPTS, PrefillProcess, decode_engine
from transfer import KVHandle

pytestmark = pytest.mark.integration  # the prefill engine runs in a spawned process

SENTINEL = 12345.0
WAIT_S = 30.0


def fragment(engine) -> list[int]:
    """Hold every even block, so a request's blocks are non-consecutive: one run per block."""
    pool = engine.block_pool
    held = pool.allocate(pool.num_free_blocks)
    pool.free([b for b in held if b % 2])
    return [b for b in held if b % 2 == 0]


def wait_until(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def lease_ended(prefill: PrefillProcess) -> bool:
    return prefill.call("stats")["num_pinned_leases"] == 0


@pytest.fixture
def model_dir(checkpoint):
    return str(checkpoint("llama"))


def abort_mid_transfer(kind: str, model_dir: str, prefill: PrefillProcess, stop_peer: bool) -> None:
    engine = decode_engine(model_dir, kind, prefill)
    try:
        held = fragment(engine)
        handle = KVHandle.decode(prefill.call("prefill", "a", PROMPTS["a"]))
        if stop_peer:
            os.kill(prefill.process.pid, signal.SIGSTOP)
        engine.add_request("a", PROMPTS["a"], GREEDY, remote_kv=handle)
        engine.step()  # admits the request and starts the pull
        pulled = engine.kv_cache.block_ids("a")
        assert len(pulled) >= 5 and engine.has_pending_transfers()
        kv = engine.runner.kv_cache
        if not stop_peer:  # abort in the middle: after the first run landed
            wait_until(lambda: bool(kv[pulled[0]].abs().sum() > 0), "the first run to land")
        engine.abort_request("a")
        engine.step()
        taken = engine.block_pool.allocate(engine.block_pool.num_free_blocks)  # another request's blocks
        kv[taken] = SENTINEL
        if stop_peer:
            os.kill(prefill.process.pid, signal.SIGCONT)
        wait_until(lambda: lease_ended(prefill), "the prefill peer to finish sending")
        late = [b for b in taken if not bool((kv[b] == SENTINEL).all())]
        assert late == [], f"late KV bytes landed in reallocated blocks {late}"
        engine.block_pool.free(taken + held)
        wait_until(lambda: engine.step() == [] and engine.stats().num_used_blocks == 0,
                   "the aborted pull's blocks to return to the pool")
    finally:
        engine.connector.transport.close()


def test_torch_abort_mid_receive_never_writes_reallocated_blocks(model_dir):
    prefill = PrefillProcess(model_dir, "torch", send_pause_s=0.3)
    try:
        abort_mid_transfer("torch", model_dir, prefill, stop_peer=False)
    finally:
        prefill.stop()


def test_nixl_abort_mid_read_never_writes_reallocated_blocks(model_dir):
    prefill = PrefillProcess(model_dir, "nixl", ucx_tls="tcp")
    try:
        abort_mid_transfer("nixl", model_dir, prefill, stop_peer=True)
    finally:
        if prefill.process.is_alive():
            os.kill(prefill.process.pid, signal.SIGCONT)
        prefill.stop()
