"""A pull across tensor-parallel splits (``pd.engine.disagg.pulls``): each KV head crosses from the prefill
engine once, to the first rank holding it; ranks that hold the same heads copy them from that rank once its
reads are done. Fake transports and workers: exact messages, states and counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pd.engine.disagg.pulls import head_holders, start_split_pull
from pd.engine.tp.driver import Pull, PullDone, Release
from pd.model.config import load_model_config
from transfer.base import HeadSlice, TransferHandle, TransferState

LOCAL_IDS = [4, 5, 6]
REMOTE_IDS = [10, 11, 12]


class FakeRead(TransferHandle):
    def __init__(self, peer: str, heads: HeadSlice | None):
        self.peer, self.heads = peer, heads
        self.state = TransferState.PENDING
        self.released = False
        self.moved_bytes = None

    @property
    def error(self) -> str | None:
        return "read failed" if self.state is TransferState.FAILED else None

    def poll(self) -> TransferState:
        return self.state

    def release(self) -> None:
        self.released = True

    def quiesced(self) -> bool:
        return self.state is not TransferState.PENDING


class FakeTransport:
    """Rank 0's transport: its reads, and the notifications sent to the prefill engine."""

    def __init__(self):
        self.reads: list[FakeRead] = []
        self.notified: list[tuple[str, str]] = []

    def local_metadata(self) -> bytes:
        return b"decode-r0"

    def read_blocks(self, peer, remote_block_ids, local_block_ids, notify, heads=None) -> FakeRead:
        assert (list(remote_block_ids), list(local_block_ids), notify) == (REMOTE_IDS, LOCAL_IDS, "")
        self.reads.append(FakeRead(peer, heads))
        return self.reads[-1]

    def notify(self, peer: str, message: str) -> None:
        self.notified.append((peer, message))


class FakeWorkers:
    """Ranks 1..N-1 as the driver sees them: what was sent to each, and the answers they give."""

    def __init__(self):
        self.sent: list[tuple[int, object]] = []
        self.answers: dict[tuple[int, int], PullDone] = {}

    def send_to(self, rank: int, message) -> None:
        self.sent.append((rank, message))

    def transport_metadata(self, rank: int) -> bytes:
        return f"decode-r{rank}".encode()

    def take_pull_done(self, rank: int, pull_id: int) -> PullDone | None:
        return self.answers.pop((rank, pull_id), None)

    def answer(self, rank: int, ok: bool = True, moved_bytes: int | None = None) -> None:
        pull_id = next(m.pull_id for r, m in self.sent if r == rank and isinstance(m, Pull))
        self.answers[(rank, pull_id)] = PullDone(pull_id, ok, None if ok else "copy failed", moved_bytes)

    def pulls(self, rank: int) -> list[Pull]:
        return [m for r, m in self.sent if r == rank and isinstance(m, Pull)]


def start(config, prefill_tp: int, decode_tp: int, attention_size: int | None = None):
    handle = SimpleNamespace(request_id="req", peer_metadata=b"prefill-r0",
                             rank_metadata=tuple(f"prefill-r{r}".encode() for r in range(1, prefill_tp)),
                             fingerprint=SimpleNamespace(tensor_parallel_size=prefill_tp))
    transport, workers = FakeTransport(), FakeWorkers()
    pull = start_split_pull(handle, config, transport, workers, decode_tp, lambda metadata: metadata.decode(),
                            list(REMOTE_IDS), list(LOCAL_IDS), attention_size)
    return pull, transport, workers


@pytest.fixture(scope="module")
def latent(checkpoint):
    return load_model_config(checkpoint("deepseek_v3"))  # MLA: one latent "head", replicated over the ranks


@pytest.fixture(scope="module")
def gqa(checkpoint):
    return load_model_config(checkpoint("llama"))  # 2 KV heads


def test_ranks_that_hold_the_same_heads_take_them_from_the_first(latent, gqa):
    assert head_holders(latent, 1, 1) == [0]
    assert head_holders(latent, 2, 2) == [0, 0]
    assert head_holders(latent, 4, 4) == [0, 0, 0, 0]
    assert head_holders(gqa, 2, 2) == [0, 1]  # split: every rank reads its own heads
    assert head_holders(gqa, 4, 4) == [0, 0, 2, 2]  # head 0 on ranks 0-1, head 1 on ranks 2-3
    assert head_holders(gqa, 2, 1) == [0, 0]  # attention whole on each expert-parallel rank


def test_a_replicated_latent_is_read_once_then_copied_to_the_other_rank(latent):
    pull, transport, workers = start(latent, prefill_tp=1, decode_tp=2)
    [read] = transport.reads
    assert (read.peer, read.heads) == ("prefill-r0", HeadSlice(0, 0, 1))
    assert workers.sent == [] and pull.poll() is TransferState.PENDING  # rank 1 reads nothing from the prefill
    read.state, read.moved_bytes = TransferState.DONE, 3000
    assert pull.poll() is TransferState.PENDING
    assert transport.notified == [("prefill-r0", "req")]  # its blocks are read: the lease ends
    [copy] = workers.pulls(1)  # from rank 0's pool, at the same block ids, whole blocks
    assert (copy.sources, copy.remote_block_ids, copy.local_block_ids) == ([(b"decode-r0", 0, 0, 1)], LOCAL_IDS,
                                                                           LOCAL_IDS)
    assert not pull.quiesced()
    workers.answer(1, moved_bytes=3000)
    assert pull.poll() is TransferState.DONE and pull.poll() is TransferState.DONE
    assert transport.notified == [("prefill-r0", "req")]  # once
    assert (pull.moved_bytes, pull.copied_bytes, pull.quiesced()) == (3000, 3000, True)


def test_a_latent_from_two_prefill_ranks_crosses_once(latent):
    pull, transport, workers = start(latent, prefill_tp=2, decode_tp=2)
    assert [(read.peer, read.heads) for read in transport.reads] == [("prefill-r0", HeadSlice(0, 0, 1))]
    assert workers.sent == []


def test_a_failed_copy_fails_the_pull_and_the_lease_is_notified_once(latent):
    pull, transport, workers = start(latent, prefill_tp=1, decode_tp=4)
    transport.reads[0].state = TransferState.DONE
    assert pull.poll() is TransferState.PENDING
    assert [len(workers.pulls(rank)) for rank in (1, 2, 3)] == [1, 1, 1]
    workers.answer(2, ok=False)
    assert pull.poll() is TransferState.FAILED and "copy failed" in pull.error
    # the copies still in flight are given up, and the pull is quiesced only once they answer
    assert sorted(rank for rank, m in workers.sent if isinstance(m, Release)) == [1, 3]
    assert not pull.quiesced()
    workers.answer(1)
    workers.answer(3)
    assert pull.quiesced() and pull.poll() is TransferState.FAILED
    assert transport.notified == [("prefill-r0", "req")]


def test_a_pull_given_up_while_reading_never_copies(latent):
    pull, transport, workers = start(latent, prefill_tp=1, decode_tp=2)
    pull.release()
    assert transport.reads[0].released and pull.poll() is TransferState.FAILED
    transport.reads[0].state = TransferState.DONE  # a read that ends after all
    assert pull.poll() is TransferState.FAILED and pull.quiesced()
    assert workers.sent == [] and transport.notified == []


def test_a_failed_read_fails_the_pull_before_any_copy(latent):
    pull, transport, workers = start(latent, prefill_tp=1, decode_tp=2)
    transport.reads[0].state = TransferState.FAILED
    assert pull.poll() is TransferState.FAILED and pull.error == "read failed"
    assert workers.sent == [] and transport.notified == [] and pull.quiesced()


def test_split_heads_are_read_by_every_rank_and_never_copied(gqa):
    pull, transport, workers = start(gqa, prefill_tp=1, decode_tp=2)
    assert [read.heads for read in transport.reads] == [HeadSlice(0, 0, 1)]
    [read] = workers.pulls(1)
    assert read.sources == [(b"prefill-r0", 1, 0, 1)]
    transport.reads[0].state, transport.reads[0].moved_bytes = TransferState.DONE, 100
    assert pull.poll() is TransferState.PENDING and transport.notified == []  # rank 1 still reads the prefill
    workers.answer(1, moved_bytes=100)
    assert pull.poll() is TransferState.DONE and transport.notified == [("prefill-r0", "req")]
    assert (pull.moved_bytes, pull.copied_bytes) == (200, 0)  # every rank's reads, as measured


def test_replicated_gqa_heads_cross_once_each_and_copy_from_their_holder(gqa):
    pull, transport, workers = start(gqa, prefill_tp=2, decode_tp=4)
    assert [(read.peer, read.heads) for read in transport.reads] == [("prefill-r0", HeadSlice(0, 0, 1))]
    [read] = workers.pulls(2)
    assert read.sources == [(b"prefill-r1", 0, 0, 1)]
    assert workers.pulls(1) == workers.pulls(3) == []
    transport.reads[0].state = TransferState.DONE
    assert pull.poll() is TransferState.PENDING and workers.pulls(1) == []  # rank 2 still reads
    workers.answer(2, moved_bytes=100)
    assert pull.poll() is TransferState.PENDING
    assert [copy.sources for copy in workers.pulls(1)] == [[(b"decode-r0", 0, 0, 1)]]
    assert [copy.sources for copy in workers.pulls(3)] == [[(b"decode-r2", 0, 0, 1)]]
    workers.answer(1)
    workers.answer(3)
    assert pull.poll() is TransferState.DONE and pull.moved_bytes is None  # rank 0's read measured nothing
