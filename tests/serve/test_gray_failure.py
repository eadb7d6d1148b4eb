"""A decode replica made slow for real (stopped and resumed on a duty cycle) is quarantined, and readmitted; or,
still slow past its deadline, replaced.

Two decode replicas under a steady streaming load. One is made five times
slower by ``SIGSTOP``/``SIGCONT`` (stopped 16 ms of every 20): alive, its
health checks pass, only slow. Its router's gray-failure detector
(``router.gray``) quarantines it, the ingress moves its streams to the
other, no stream fails, and once the fault ends the probes readmit it. A
fault that outlasts ``replace_after_s`` has Serve replace the replica.

Destructive (a stopped process): runs last, on its own app.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from bench.gray_isolation import DutyCycle, StreamingLoad
from bench.gray_isolation import ingress_stats as _ingress_stats
from tests.serve.conftest import ensure_app, pool_stats, replica_ids, wait_until

pytestmark = pytest.mark.destructive

GRAY = {"window_s": 3.0, "half_life_s": 1.0, "probe_interval_s": 2.0, "min_replica_steps": 8.0,
        "stale_after_s": 10.0}


def test_a_slow_decode_replica_is_quarantined_its_streams_move_and_it_is_readmitted(ray_cluster):
    decode = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 64,
              "router": {"gray_failure": GRAY}}
    ensure_app("default.yaml", decode=decode, max_migrations=1)
    wait_until(lambda: len(replica_ids("pd", "DecodeServer")) == 2, timeout=90)
    with StreamingLoad(ray_cluster["url"]) as load:
        wait_until(lambda: len(load.outcomes) >= 6, timeout=60)
        baseline_from = time.monotonic()
        time.sleep(8)  # the no-fault baseline's window: tokens arriving, not synchronisation
        baseline = load.itl_p99(baseline_from, time.monotonic())
        slow = max(pool_stats("DecodeServer"), key=lambda s: s["num_running"])
        with DutyCycle(slow["pid"]):
            fault_at = time.monotonic()
            trajectory = []

            def quarantined() -> bool:
                stats = _ingress_stats()
                trajectory.append((round(time.monotonic() - fault_at, 1),
                                   round(stats["slowness"]["decode"].get(slow["replica_id"], 0.0), 2)))
                return stats["quarantined"]["decode"] == [slow["replica_id"]]

            try:
                wait_until(quarantined, timeout=30, interval=1.0)
            except TimeoutError:
                raise AssertionError(f"not quarantined in 30 s: {_ingress_stats()}, slow {slow['replica_id']}, "
                                     f"{len(load.outcomes)} streams") from None
            quarantined_after = time.monotonic() - fault_at
            settled = time.monotonic() + 3.0  # streams already moved; the next ones go to the healthy replica
            wait_until(lambda: time.monotonic() >= settled + 8, timeout=20, interval=0.5)
            after = load.itl_p99(settled, time.monotonic())
        wait_until(lambda: _ingress_stats()["quarantined"]["decode"] == [], timeout=60)
    failed = [outcome for outcome in load.outcomes if outcome != "done"]
    print(json.dumps({"quarantined_after_s": round(quarantined_after, 2), "itl_p99_baseline_s": round(baseline, 4),
                      "itl_p99_after_quarantine_s": round(after, 4), "ratio": round(after / baseline, 2),
                      "streams": len(load.outcomes), "itl_median_s": statistics.median(g for _, g in load.gaps),
                      "slowness": trajectory}))
    assert not failed, failed[:5]
    assert quarantined_after <= 30.0
    assert after <= 2.0 * baseline, (after, baseline)


def test_a_replica_still_slow_past_its_deadline_is_replaced_by_serve(ray_cluster):
    """Quarantined past ``replace_after_s``, the replica fails its health checks on the ingress's request, and
    Serve stops it and starts another; no stream fails."""
    decode = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 64,
              "health_check_period_s": 1.0, "router": {"gray_failure": {**GRAY, "replace_after_s": 4.0}}}
    ensure_app("default.yaml", decode=decode, max_migrations=1)
    wait_until(lambda: len(replica_ids("pd", "DecodeServer")) == 2, timeout=90)
    with StreamingLoad(ray_cluster["url"], clients=4) as load:
        wait_until(lambda: len(load.outcomes) >= 4, timeout=60)
        slow = max(pool_stats("DecodeServer"), key=lambda s: s["num_running"])
        with DutyCycle(slow["pid"]) as fault:
            fault_at = time.monotonic()
            wait_until(lambda: _ingress_stats()["quarantined"]["decode"] == [slow["replica_id"]], timeout=30)
            quarantined_after = time.monotonic() - fault_at
            try:
                wait_until(lambda: fault.gone or slow["replica_id"] not in replica_ids("pd", "DecodeServer"),
                           timeout=60)
            except TimeoutError:
                raise AssertionError(f"{slow['replica_id']} not replaced in 60 s: {_ingress_stats()}") from None
            replaced_after = time.monotonic() - fault_at
        wait_until(lambda: len(replica_ids("pd", "DecodeServer")) == 2, timeout=90)
        assert slow["replica_id"] not in replica_ids("pd", "DecodeServer")
        streams_before = len(load.outcomes)
        wait_until(lambda: len(load.outcomes) >= streams_before + 4, timeout=60)  # the pool serves on
    print(json.dumps({"quarantined_after_s": round(quarantined_after, 2), "replaced_after_s": round(replaced_after, 2),
                      "streams": len(load.outcomes)}))
    failed = [outcome for outcome in load.outcomes if outcome != "done"]
    assert not failed, failed[:5]
