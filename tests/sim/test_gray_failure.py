"""The gray-failure detector in simulated time, unmodified (``router.gray`` in ``SimCluster``'s decode router)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pd.workload.trace import BurstyTraceConfig, generate_bursty
from router.gray import GrayFailureConfig
from sim.clock import EventLoop
from sim.cluster import SimCluster
from sim.workload import submit_trace
from tests.sim.test_cluster import COST, spec

SLOW = "decode-3"
TERMS = ("base_s", "per_token_s", "per_pair_s", "per_seq_s", "per_sample_s")


def _served(minutes: float, slowdown: float = 1.0, rate: float = 2.0) -> SimCluster:
    """Four decode replicas under the load tests' bursty profile (a diurnal ramp with a 3x step).

    ``cluster.sent`` lists each stream's (time, decode replica), as the decode pool is told of it.
    """
    cluster = SimCluster(EventLoop(), spec(num_prefill=1, num_decode=4, gray_failure=GrayFailureConfig()))
    cluster.sent = []
    told = cluster.decode.sent
    cluster.decode.sent = lambda replica_id: (cluster.sent.append((cluster.loop.now, replica_id)), told(replica_id))
    if slowdown != 1.0:
        runner = cluster.decode.replicas[SLOW].engine.runner
        runner.cost = dataclasses.replace(COST, **{name: slowdown * getattr(COST, name) for name in TERMS})
    trace = generate_bursty(BurstyTraceConfig(duration_s=60.0 * minutes, base_rate_per_s=rate, system_prompt_tokens=64,
                                              user_tokens=(100, 600), output_tokens=(16, 96)))
    submit_trace(cluster, trace)
    cluster.loop.run()
    return cluster


def test_a_decode_replica_five_times_slower_is_quarantined_within_30_s_and_gets_no_new_stream():
    cluster = _served(minutes=1.5, slowdown=5.0)
    quarantines = [change for change in cluster.gray_changes if change.kind == "quarantined"]
    assert [change.replica_id for change in quarantines] == [SLOW]
    assert quarantines[0].at_s <= 30.0 and quarantines[0].slowness >= 3.0
    assert any(replica == SLOW for at, replica in cluster.sent if at < quarantines[0].at_s)
    assert not any(replica == SLOW for at, replica in cluster.sent if at > quarantines[0].at_s)


@pytest.mark.slow
def test_ten_minutes_of_bursty_load_without_a_fault_quarantine_nothing():
    started = time.process_time()
    cluster = _served(minutes=10.0)
    assert len(cluster.records) > 1000 and all(r.finished_s is not None for r in cluster.records.values())
    assert cluster.gray_changes == []
    assert max(cluster.gray.slowness(r) for r in cluster.decode.replica_ids) < 2.0
    print(f"10 simulated minutes in {time.process_time() - started:.1f} CPU-s")
