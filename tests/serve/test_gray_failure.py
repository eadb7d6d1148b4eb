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

import http.client
import json
import os
import signal
import statistics
import threading
import time
import urllib.parse
import uuid

import pytest

from tests.serve.conftest import ensure_app, pool_stats, replica_ids, wait_until

pytestmark = pytest.mark.destructive

MODEL = "builtin:tiny-llama"
GRAY = {"window_s": 3.0, "half_life_s": 1.0, "probe_interval_s": 2.0, "min_replica_steps": 8.0,
        "stale_after_s": 10.0}
STOPPED_S, PERIOD_S = 0.016, 0.02  # five times slower; short, so that stops land inside steps


def _ingress_stats() -> dict:
    from ray import serve

    return serve.get_app_handle("pd").process_stats.remote().result()


class StreamingLoad:
    """``workers`` clients, each streaming one short completion after another; every token's arrival time."""

    def __init__(self, url: str, workers: int = 6, max_tokens: int = 48):
        self.url, self.max_tokens = urllib.parse.urlsplit(url), max_tokens
        self.outcomes: list[str] = []
        self.gaps: list[tuple[float, float]] = []  # (arrival time, gap since the stream's previous token)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def __enter__(self) -> "StreamingLoad":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.outcomes.append(self._one())

    def _one(self) -> str:
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({
                "model": MODEL, "prompt": f"{uuid.uuid4().hex} tell me", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                return f"status {response.status}"
            last, events = None, []
            for line in response:
                if line.startswith(b"data: {"):
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append((now, now - last))
                    last = now
                    events.append(json.loads(line[6:]))
            finish = events[-1]["choices"][0]["finish_reason"] if events and events[-1].get("choices") else None
            return "done" if finish == "length" else f"ended {events[-1] if events else 'empty'}"
        except Exception as exc:  # noqa: BLE001 - any failure is an outcome the test reports
            return f"failed {exc!r}"
        finally:
            conn.close()

    def itl_p99(self, since: float, until: float) -> float:
        gaps = sorted(gap for at, gap in self.gaps if since <= at < until)
        assert len(gaps) >= 50, f"only {len(gaps)} tokens between {since:.1f} and {until:.1f}"
        return gaps[int(0.99 * (len(gaps) - 1))]


class DutyCycle:
    """Stops and resumes a process on a duty cycle until closed; the process is always left running."""

    def __init__(self, pid: int):
        self.pid = pid
        self.gone = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "DutyCycle":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)
        if not self.gone:
            os.kill(self.pid, signal.SIGCONT)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._stop.wait(STOPPED_S)
                os.kill(self.pid, signal.SIGCONT)
                self._stop.wait(PERIOD_S - STOPPED_S)
        except ProcessLookupError:  # the process is gone (Serve replaced its replica)
            self.gone = True


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
    with StreamingLoad(ray_cluster["url"], workers=4) as load:
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
