"""Replica deaths under load: no hangs, no garbage, no leaked blocks or leases.

Destructive: these run last (see tests/conftest.py), on their own app.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.serve.conftest import ensure_app, pool_stats, replica_ids, wait_until

MODEL = "builtin:tiny-llama"
LONG = " ".join(f"word{i}" for i in range(150))
FAULT_APP = {"prefill_timeout_s": 4.0}

pytestmark = pytest.mark.destructive


def _stream(client, prompt: str, max_tokens: int) -> str:
    """'done', 'error' (an error event ended the stream) or 'broken' (anything else)."""
    status, text = client.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True,
    })
    if status != 200:
        return "error" if status in (429, 500, 503) else "broken"
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if events and events[-1] == "[DONE]":
        # ignore_eos: a whole answer runs to max_tokens and says so.
        last = json.loads(events[-2]) if len(events) > 1 else {}
        finished = last.get("choices") and last["choices"][0]["finish_reason"] == "length"
        return "done" if finished else "broken"
    return "error" if events and "error" in json.loads(events[-1]) else "broken"


class Load:
    """About 8 streams in flight until stopped; records each stream's outcome."""

    def __init__(self, client, num_streams: int = 8, max_tokens: int = 24):
        self.client, self.max_tokens = client, max_tokens
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_streams)]

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            prompt = LONG if index % 2 == 0 else f"short prompt {index}"
            self.outcomes.append(_stream(self.client, prompt, self.max_tokens))

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        assert not any(t.is_alive() for t in self._threads), "a stream hung"


def _kill(deployment: str) -> str:
    import ray

    [replica] = replica_ids("pd", deployment)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::pd#{deployment}#{replica}", namespace="serve"), no_restart=True)
    return replica


def _all_clean() -> bool:
    try:
        stats = pool_stats("PrefillServer") + pool_stats("DecodeServer")
    except Exception:  # a replica still starting
        return False
    return all(s["num_used_blocks"] == 0 and s["num_pinned_leases"] == 0 and s["num_running"] == 0 for s in stats)


def _serves_again(client) -> bool:
    return _stream(client, LONG, 4) == "done" and _stream(client, "hi", 4) == "done"


@pytest.fixture
def fault_app(ray_cluster):
    from tests.serve.conftest import Client

    ensure_app("default.yaml", **FAULT_APP)
    client = Client(ray_cluster["url"])
    wait_until(lambda: _serves_again(client), timeout=60)
    return client


def _kill_under_load(client, deployment: str) -> list[str]:
    """Kill the pool's replica while 8 streams run; return every stream's outcome once Serve replaced it."""
    with Load(client) as load:
        wait_until(lambda: len(load.outcomes) >= 4, timeout=60)
        killed = _kill(deployment)
        wait_until(lambda: replica_ids("pd", deployment) and replica_ids("pd", deployment) != [killed], timeout=60)
        before = len(load.outcomes)
        wait_until(lambda: len(load.outcomes) >= before + 8, timeout=90)
    return load.outcomes


def test_killing_the_prefill_replica_under_load(fault_app):
    outcomes = _kill_under_load(fault_app, "PrefillServer")
    # Requests retry elsewhere or prefill locally: at most the streams in flight may end in an error event.
    assert "broken" not in outcomes, outcomes
    assert outcomes.count("done") >= len(outcomes) - 8, outcomes
    wait_until(lambda: _serves_again(fault_app), timeout=30)
    wait_until(_all_clean, timeout=30)


def test_killing_the_decode_replica_under_load(fault_app):
    outcomes = _kill_under_load(fault_app, "DecodeServer")
    # Streams on the dead replica end with an error event, never a hang or a silent cut.
    assert "broken" not in outcomes, outcomes
    wait_until(lambda: _serves_again(fault_app), timeout=30)
    # Leases the dead decode replica never pulled expire on the prefill side (3 s in tests).
    wait_until(_all_clean, timeout=30)


def test_overload_beyond_queue_bounds_is_refused_quickly(ray_cluster):
    from concurrent.futures import ThreadPoolExecutor

    from tests.serve.conftest import Client

    ensure_app("default.yaml", ingress={"num_replicas": 1, "max_ongoing_requests": 2, "max_queued_requests": 2,
                                        "ray_actor_options": {"num_cpus": 0.25}})
    client = Client(ray_cluster["url"])
    wait_until(lambda: _serves_again(client), timeout=60)

    def one(_):
        start = time.monotonic()
        status, _ = client.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": LONG, "max_tokens": 64, "temperature": 0, "ignore_eos": True})
        return status, time.monotonic() - start

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    refused = [elapsed for status, elapsed in results if status == 503]
    served = [status for status, _ in results if status == 200]
    assert refused and served, results
    assert len(refused) + len(served) == len(results), results
    assert max(refused) < 5.0, results  # refused at once, not after queueing
    wait_until(_all_clean, timeout=30)
