"""A 5-minute mixed-workload locust soak of the default app. Skipped unless PD_SOAK=1.

    PD_SOAK=1 .venv/bin/python -m pytest -q -s tests/serve/test_soak.py

Prints one JSON line with the figures: requests, failures, and each replica's
resident memory after warm-up and at the end.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from pd.workload.records import Status, read_requests
from tests.serve.conftest import pool_stats, wait_until
from tests.serve.test_app_loadtest import _locust

pytestmark = pytest.mark.soak

SOAK_S = int(os.environ.get("PD_SOAK_SECONDS", "300"))
WARMUP_S = 60


def replica_rss() -> dict[str, int]:
    """Resident memory of every replica of the app, as each reports it."""
    from ray import serve

    rss = {f"{pool}#{s['replica_id']}": s["rss_bytes"]
           for pool in ("PrefillServer", "DecodeServer") for s in pool_stats(pool)}
    rss["Ingress"] = serve.get_deployment_handle("Ingress", "pd").process_stats.remote().result()["rss_bytes"]
    return rss


def test_soak_mixed_workload(default_app, tmp_path):
    warm: dict[str, int] = {}
    timer = threading.Timer(WARMUP_S, lambda: warm.update(replica_rss()))
    timer.start()
    try:
        done = _locust(default_app.url, tmp_path / "soak", "-u", "6", "-r", "2", "--run-time", f"{SOAK_S}s",
                       "--workload", "mixed", "--max-tokens", "32", timeout=SOAK_S + 120)
    finally:
        timer.cancel()
    end = replica_rss()
    records = read_requests(tmp_path / "soak_requests.csv")
    failed = [r for r in records if r.status == Status.FAILED]
    growth = {name: end[name] / warm[name] - 1 for name in warm if name in end}
    print(json.dumps({"soak_s": SOAK_S, "requests": len(records), "failed": len(failed),
                      "rss_mb_after_warmup": {k: round(v / 2**20) for k, v in warm.items()},
                      "rss_mb_end": {k: round(v / 2**20) for k, v in end.items()},
                      "rss_growth": {k: round(v, 3) for k, v in growth.items()}}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not failed
    assert growth and all(g < 0.10 for g in growth.values()), growth
    wait_until(lambda: all(s["num_used_blocks"] == 0 and s["num_pinned_leases"] == 0
                           for s in pool_stats("PrefillServer") + pool_stats("DecodeServer")), timeout=30)
