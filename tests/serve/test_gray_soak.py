"""Ten minutes of the bursty profile on the two-node test cluster, no fault: nothing is quarantined.

    PD_SOAK=1 .venv/bin/python -m pytest -q -s tests/serve/test_gray_soak.py

Two prefill and two decode replicas, the gray-failure detector on both pools
with its defaults (as ``serve_configs/default.yaml`` has it). Between 1 and 8
clients stream completions, as many as the load tests' bursty profile gives
at that moment (``bench.gray_isolation.bursty_clients``: a diurnal ramp with
a 3x step), every fourth a long prompt prefilled remotely. Each second the
ingress's quarantine and slowness are read. Skipped unless PD_SOAK=1;
``PD_SOAK_SECONDS`` shortens it. Prints one JSON line with the figures.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest

from bench.gray_isolation import StreamingLoad, bursty_clients, ingress_stats
from tests.serve.conftest import ensure_app, replica_ids, wait_until

pytestmark = pytest.mark.soak

SOAK_S = float(os.environ.get("PD_SOAK_SECONDS", "600"))
POOL = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 64,
        "max_queued_requests": 128, "router": {"gray_failure": {}}}


@pytest.mark.timeout(SOAK_S + 300)
def test_ten_minutes_of_bursty_load_without_a_fault_quarantine_nothing(ray_cluster):
    ensure_app("default.yaml", prefill=POOL, decode=POOL, max_migrations=1)
    wait_until(lambda: len(replica_ids("pd", "DecodeServer")) == 2 == len(replica_ids("pd", "PrefillServer")),
               timeout=120)
    held: list[tuple[float, dict]] = []
    worst = {"prefill": [], "decode": []}
    with StreamingLoad(ray_cluster["url"], clients=8, active=bursty_clients(8, SOAK_S), long_every=4) as load:
        while (t := time.monotonic() - load.started) < SOAK_S:
            stats = ingress_stats()
            if any(stats["quarantined"].values()):
                held.append((round(t, 1), stats["quarantined"]))
            for pool in worst:
                worst[pool].append(max(stats["slowness"][pool].values(), default=0.0))
            time.sleep(max(0.0, load.started + t + 1.0 - time.monotonic()))  # the next sample, a second on
    failed = [outcome for outcome in load.outcomes if outcome != "done"]
    print(json.dumps({"soak_s": SOAK_S, "streams": len(load.outcomes), "failed": len(failed),
                      "quarantined_samples": len(held), "first_quarantine": held[0] if held else None,
                      **{f"{pool}_slowness_max": round(max(v), 2) for pool, v in worst.items()},
                      **{f"{pool}_slowness_median": round(statistics.median(v), 2) for pool, v in worst.items()},
                      "itl_median_s": round(statistics.median(g for _, g in load.gaps), 4)}))
    assert not held, held[:5]
    assert not failed, failed[:5]
