"""The SLO planner sizing the pools for real: a load step, a scale-down that loses nothing, a kill while draining.

Destructive: these run last (see tests/conftest.py), on their own app, with
short periods and delays so that each scale takes seconds. The app's args, the
replica views and the load generators are in ``tests/serve/autoscaling_helpers.py``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serve.autoscaling_helpers import (
    PHASES,
    PacedLoad,
    Timeline,
    all_clean,
    decode_from,
    going_away,
    leases_on_each,
    long_stream,
    planner_app,
    planner_decisions,
    prefill_capacity,
    replicas,
    running,
    running_streams,
    step_trace,
)
from tests.serve.conftest import Client, config_args, ensure_app, fresh_app, pool_stats, wait_until
from tests.serve.test_app_loadtest import _locust

pytestmark = [pytest.mark.destructive, pytest.mark.integration]

SERVE_DRAIN_LOOP_S = 2.0  # Serve's graceful_shutdown_wait_loop_s: how often a stopping replica checks its calls
# A decode step of the test model at a 512-token context on one thread: 6.7 ms, and 1.2 ms more per
# sequence on an Intel Xeon core (sim.profile); twice that here, for the contention. The planner's
# correction (4x at most) covers the step's longer contexts.
DECODE_CAPACITY = {"decode_step_s": 0.015, "decode_step_per_seq_s": 0.003}
# Twice the config's own KV pool: 126 of the step's sequences a replica at 4 MiB each (the tests'
# 64 MiB holds 15, and the planner sizes decode on KV too).
LOAD_STEP_KV_BYTES = 512 * 1024**2
LOAD_STEP_QUEUE_BOUND = 1024  # more than the whole trace: every prompt waits for the prefill pool


@dataclass
class DrainedLease:
    """The prefill replica the planner took away while it held a lease, and what the lease's decode gave."""

    replica_id: str
    leases: dict[str, tuple[object, list[int]]]  # every prefill replica's pinned lease: id -> (result, prompt)
    tokens: list[int]
    sources: set


def _start_locust(url: str, trace: Path, run_dir: Path) -> threading.Thread:
    """Locust replaying ``trace`` on a thread; its completed process lands in the thread's ``done``."""
    locust = threading.Thread(target=lambda: setattr(locust, "done", _locust(
        url, run_dir / "locust", "--trace-file", str(trace), "--max-tokens", "4",
        "--slo-ttft-ms", "5000", "-u", "1", "-r", "1", "--run-time", "120s", timeout=200)))
    locust.start()
    return locust


def _lease_outlives_drain(timeline: Timeline, offline) -> DrainedLease:
    """Once the load drops, both replicas get a lease no decode has pulled: the one going away must keep
    serving its KV until the lease ends."""
    high_ends = timeline.started + PHASES[0][0] + PHASES[1][0]
    wait_until(lambda: time.monotonic() >= high_ends and running("PrefillServer") == 2, timeout=60)
    leases = leases_on_each(offline)
    assert len(leases) == 2, leases
    replica_id, _ = going_away("PrefillServer")
    # Serve's own drain (no calls in flight, checked every 2 s) is over well before this: only the
    # lease keeps the replica up now.
    stopping_since = time.monotonic()
    while time.monotonic() - stopping_since < 3 * SERVE_DRAIN_LOOP_S:
        assert replica_id in replicas("PrefillServer"), "exited while its lease was pinned"
        time.sleep(0.25)
    result, token_ids = leases[replica_id]
    tokens, sources = decode_from(result, token_ids)
    return DrainedLease(replica_id, leases, tokens, sources)


def _check_leases_and_load(drained: DrainedLease, offline, locust_done, run_dir: Path, num_requests_sent: int):
    from pd.engine.request import KVSource
    from tests.serve.test_app_loadtest import _stats

    assert drained.sources == {KVSource.REMOTE}, drained.sources  # pulled from the draining replica, not recomputed
    _, token_ids = drained.leases[drained.replica_id]
    assert drained.tokens == offline(token_ids, 8)
    for other_id, (other, other_ids) in drained.leases.items():
        if other_id != drained.replica_id:
            assert decode_from(other, other_ids)[0] == offline(other_ids, 8)
    assert locust_done.returncode == 0, locust_done.stdout[-3000:] + locust_done.stderr[-3000:]
    stats = _stats(run_dir / "locust")
    assert sum(int(row["Failure Count"]) for row in stats.values()) == 0
    num_requests = sum(int(row["Request Count"]) for (kind, _), row in stats.items() if kind == "E2E")
    assert num_requests == num_requests_sent


def _decode_work(decode_before: dict) -> list[dict]:
    """What each decode replica did since ``decode_before``: prompt tokens it computed itself (overflow, or a
    pull given up: 0 when all went well), and its pulls."""
    counters = {"computed_prompt_tokens": "num_computed_prompt_tokens", "pulls": "num_remote_pulls",
                "pull_seconds": "pull_seconds_total"}
    return [{name: round(now[key] - decode_before[key], 2) for name, key in counters.items()}
            for now in pool_stats("DecodeServer")]


def test_a_load_step_scales_prefill_out_and_back_and_loses_nothing(ray_cluster, offline, tmp_path):
    # Decode's capacity and KV pool are set well above what this load asks of it, and the step is the
    # prefill pool's alone: long prompts (decode's load is per request) and a queue bound past the
    # trace (beyond it, the ingress prefills at decode). Two prefill replicas, locust and the ingress
    # share two cores with decode: on CI's host, with 512-token prompts at 7.9 a second, decode once
    # planned for 67 sequences in flight and rightly wanted a second replica.
    engine = {**config_args("autoscaling.yaml")["engine"], "kv_cache_bytes": LOAD_STEP_KV_BYTES}
    ensure_app("autoscaling.yaml", **planner_app(decode=DECODE_CAPACITY, engine=engine,
                                                 prefill_queue_bound=LOAD_STEP_QUEUE_BOUND))
    client = Client(ray_cluster["url"])
    wait_until(lambda: running("PrefillServer") == 1 and running("DecodeServer") == 1, timeout=60)
    capacity = prefill_capacity(client)
    rates = step_trace(tmp_path / "step.jsonl", capacity)
    num_requests_sent = len((tmp_path / "step.jsonl").read_text().splitlines())
    step_at = PHASES[0][0]
    run_dir = tmp_path / "run"
    [decode_before] = pool_stats("DecodeServer")
    with Timeline() as timeline:
        locust = _start_locust(client.url, tmp_path / "step.jsonl", run_dir)
        try:
            scaled_out = wait_until(lambda: timeline.first(lambda s: s["prefill"] == 2), timeout=60)
        except TimeoutError:
            raise AssertionError(f"no scale-out at {rates} requests/s, capacity {capacity:.0f} tokens/s") from None
        drained = _lease_outlives_drain(timeline, offline)
        locust.join(200)
        wait_until(lambda: replicas("PrefillServer").keys() == {rid for rid in drained.leases
                                                                if rid != drained.replica_id}, timeout=60)
    _check_leases_and_load(drained, offline, locust.done, run_dir, num_requests_sent)
    decode_work = _decode_work(decode_before)
    scaled_in = timeline.first(lambda s: s["prefill"] == 1 and s["prefill_other"] == 0, after=scaled_out)
    print(json.dumps({"prefill_capacity_tokens_per_s": round(capacity), "rates_per_s": [round(r, 2) for r in rates],
                      "load_step_at_s": step_at, "prefill_2_at_s": scaled_out, "prefill_back_to_1_at_s": scaled_in,
                      "decode": decode_work, "max_decode": max(s["decode"] + s["decode_other"] for s in timeline.samples),
                      "timeline": timeline.changes()}))
    assert scaled_out - step_at <= 30.0
    assert all(s["decode"] + s["decode_other"] == 1 for s in timeline.samples), \
        "\n".join([*planner_decisions(), f"decode: {decode_work}"])
    wait_until(all_clean, timeout=30)


def test_the_draining_prefill_replica_killed_loses_no_request(ray_cluster, offline):
    """Two prefill replicas and light load: the planner scales to one; the one going away dies while it drains."""
    from pd.engine.request import KVSource

    # Idle from the start, the planner wants one replica at once: the delay leaves time to see two.
    ensure_app("autoscaling.yaml", **planner_app(prefill={"initial_replicas": 2, "slo_ttft_s": 2.0,
                                                          "scale_down_delay_s": 25.0}))
    client = Client(ray_cluster["url"])
    wait_until(lambda: running("PrefillServer") == 2, timeout=90)
    leases = leases_on_each(offline)
    with PacedLoad(client) as load:
        replica_id, pid = going_away("PrefillServer")
        os.kill(pid, signal.SIGKILL)
        result, token_ids = leases[replica_id]
        tokens, sources = decode_from(result, token_ids)
        wait_until(lambda: len(load.outcomes) >= 4, timeout=60)
    assert sources == {KVSource.RECOMPUTE}, sources  # its KV went with it: recomputed, never garbage
    assert tokens == offline(token_ids, 8)
    assert set(load.outcomes) == {"done"}, load.outcomes
    for other_id, (other, other_ids) in leases.items():
        if other_id != replica_id:
            assert decode_from(other, other_ids)[0] == offline(other_ids, 8)
    wait_until(lambda: running("PrefillServer") == 1 and len(replicas("PrefillServer")) == 1, timeout=60)
    wait_until(all_clean, timeout=30)


def test_decode_scaled_down_under_long_streams_moves_them_and_breaks_none(ray_cluster):
    """Two decode replicas and a few streams longer than the graceful window: the one going away is stopped
    mid-stream, and its streams move to the other replica and go on there.

    Once a stream has moved and the replica is gone, each stream reads some more tokens and disconnects: a
    moved stream has then gone on past the move, and the rest of 3,000 tokens (half a minute on two cores)
    would show nothing more. The disconnects free what the streams held, as ``all_clean`` checks."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.serve.test_faults import _ingress_stats

    args = planner_app(decode={"initial_replicas": 2, "scale_down_delay_s": 4.0})
    args["decode"]["graceful_shutdown_timeout_s"] = 1.0
    # A fresh app, not a rolling update of the last one: the old replicas' reports would measure the
    # pool's capacity and start the scale-down clock while the second new replica is still starting
    # (on a slow machine, past the delay). Fresh replicas have no decode steps, so nothing is planned
    # until the streams run on both.
    fresh_app("autoscaling.yaml", **args)
    client = Client(ray_cluster["url"])
    wait_until(lambda: running("DecodeServer") == 2, timeout=90)
    migrations_before = _ingress_stats()["num_migrations"]
    with ThreadPoolExecutor(4) as pool:
        # The scale-down comes 6-8 s in, and the replica is stopped 1 s later: the streams must outlast
        # that on any host. 1,000 tokens lasted about 20 s on a 2-core AMD EPYC but finished before the
        # scale-down on a faster 2-core Xeon (nothing running, nothing moved), as 500 had before; 3,000
        # (of the model's 4,096 positions) last past it on both.
        enough = threading.Event()
        streams = [pool.submit(long_stream, client, i, 3000, enough) for i in range(4)]
        busy = {}  # replica id -> streams running on it, sampled until one replica is going away
        try:  # on any way out, the streams are cut: a failure does not wait for 3,000 tokens
            [gone] = wait_until(lambda: busy.update(running_streams())
                                or [rid for rid, (state, _) in replicas("DecodeServer").items() if state == "STOPPING"],
                                timeout=60)
            wait_until(lambda: _ingress_stats()["num_migrations"] > migrations_before
                       and gone not in replicas("DecodeServer"), timeout=60)
        except TimeoutError:
            raise AssertionError(f"no replica stopped, or it stayed, or no stream moved: {replicas('DecodeServer')}, "
                                 f"{_ingress_stats()['num_migrations']} migrations, {migrations_before} before, "
                                 f"streams on each {busy}") from None
        finally:
            enough.set()
        outcomes = [stream.result(timeout=180) for stream in streams]
    assert set(outcomes) <= {"done", "cut"}, outcomes
    assert busy.get(gone, 0) > 0, busy  # it was stopped with streams on it, which moved and went on
    wait_until(lambda: running("DecodeServer") == 1 and len(replicas("DecodeServer")) == 1, timeout=60)
    wait_until(all_clean, timeout=30)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
