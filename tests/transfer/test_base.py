"""``block_runs``: pairwise merging of block-id lists into contiguous runs; ``DelayedRead``, the stalled-link fault."""

from __future__ import annotations

import pytest

from transfer import block_runs
from transfer.base import DelayedRead, FinishedHandle, TransferState


@pytest.mark.parametrize(
    "remote_ids, local_ids, runs",
    [
        ([], [], []),
        ([5], [9], [(5, 9, 1)]),
        ([0, 1, 2, 3], [4, 5, 6, 7], [(0, 4, 4)]),
        ([7, 8, 9, 4, 5], [0, 1, 2, 3, 9], [(7, 0, 3), (4, 3, 1), (5, 9, 1)]),
        ([1, 2, 3], [1, 3, 4], [(1, 1, 1), (2, 3, 2)]),  # consecutive remotely, split locally
        ([3, 2, 1], [0, 1, 2], [(3, 0, 1), (2, 1, 1), (1, 2, 1)]),  # descending never merges
        ([4, 4], [0, 1], [(4, 0, 1), (4, 1, 1)]),  # a repeated remote block is two runs
    ],
)
def test_block_runs_merge_only_where_both_sides_advance(remote_ids, local_ids, runs):
    assert block_runs(remote_ids, local_ids) == runs
    expanded = [(r + i, l + i) for r, l, n in runs for i in range(n)]
    assert expanded == list(zip(remote_ids, local_ids))


def test_block_runs_refuse_unequal_lengths():
    with pytest.raises(ValueError, match="3 remote blocks but 2 local blocks"):
        block_runs([1, 2, 3], [1, 2])


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_delayed_read_is_pending_until_posted_then_is_the_read():
    clock, posted = _Clock(), []

    def issue():
        posted.append(clock.now)
        return FinishedHandle()

    read = DelayedRead(issue, 0.4, clock)
    assert read.poll() is TransferState.PENDING and read.error is None and not posted
    clock.now += 0.39
    assert read.poll() is TransferState.PENDING
    clock.now += 0.02
    assert read.poll() is TransferState.DONE and posted == [clock.now] and read.quiesced()


def test_a_delayed_read_given_up_before_it_is_posted_posts_nothing():
    clock, posted = _Clock(), []
    read = DelayedRead(lambda: posted.append(1) or FinishedHandle(), 0.4, clock)
    read.release()
    clock.now += 1.0
    assert read.poll() is TransferState.FAILED and "before it was posted" in read.error
    assert read.quiesced() and not posted


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_the_pull_delay_fault_refuses_a_value_that_is_not_seconds(monkeypatch, value):
    from pd.engine.disagg.connector import FAULT_PULL_DELAY_ENV, _fault_pull_delay_s

    monkeypatch.setenv(FAULT_PULL_DELAY_ENV, value)
    with pytest.raises(ValueError, match=f"{FAULT_PULL_DELAY_ENV} must be a number of seconds"):
        _fault_pull_delay_s()
    monkeypatch.setenv(FAULT_PULL_DELAY_ENV, "0.25")
    assert _fault_pull_delay_s() == 0.25
