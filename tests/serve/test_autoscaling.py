"""The SLO planner sizing the pools for real: a load step, a scale-down that loses nothing, a kill while draining.

Destructive: these run last (see tests/conftest.py), on their own app, with
short periods and delays so that each scale takes seconds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.serve.conftest import Client, config_args, ensure_app, fresh_app, pool_stats, wait_until
from tests.serve.test_app_loadtest import _locust

pytestmark = pytest.mark.destructive

PERIOD_S = 2.0
SCALE_DOWN_DELAY_S = 6.0
MODEL = "builtin:tiny-llama"
SERVE_DRAIN_LOOP_S = 2.0  # Serve's graceful_shutdown_wait_loop_s: how often a stopping replica checks its calls
PROMPT_TOKENS = 512  # one trace block: every prompt is new to every cache, so it prefills remotely
# The load step's prompts: two trace blocks, each new to every cache. Decode's load is per request,
# so longer prompts keep the step on prefill (on CI's faster host, 512-token ones came at 7.9 a
# second); much longer ones make each period's demand spiky at the low rates.
STEP_PROMPT_TOKENS = 2 * PROMPT_TOKENS
# The load step, as (seconds, share of one prefill replica's capacity measured just before), 15x.
# High, one replica cannot keep up, so the planner wants two whatever its latency correction; low,
# a prompt's own compute is most of its TTFT, and one replica is enough (half busy at most where
# that compute alone misses the target, as on a loaded host).
PHASES = ((8.0, 0.08), (24.0, 1.2), (24.0, 0.08))
# A decode step of the test model at a 512-token context on one thread: 6.7 ms, and 1.2 ms more per
# sequence on an Intel Xeon core (sim.profile); twice that here, for the contention. The planner's
# correction (4x at most) covers the step's longer contexts.
DECODE_CAPACITY = {"decode_step_s": 0.015, "decode_step_per_seq_s": 0.003}
# Twice the config's own KV pool: 126 of the step's sequences a replica at 4 MiB each (the tests'
# 64 MiB holds 15, and the planner sizes decode on KV too).
LOAD_STEP_KV_BYTES = 512 * 1024**2
LOAD_STEP_QUEUE_BOUND = 1024  # more than the whole trace: every prompt waits for the prefill pool


def planner_app(**overrides) -> dict:
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "period_s": PERIOD_S,
                   "scale_down_delay_s": SCALE_DOWN_DELAY_S, "forecast_periods": 1.0}
    args = {
        "kv_lease_s": 60.0,  # long enough to outlive the start of its replica's scale-down
        "prefill_timeout_s": 20.0,
        "remote_prefill_threshold": 64,
        "prefill": {"ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 32,
                    "autoscaling": {**autoscaling, "slo_ttft_s": 1.5}},
        "decode": {"ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 64,
                   "autoscaling": {**autoscaling, "slo_itl_s": 1.0}},
    }
    for pool in ("prefill", "decode"):
        args[pool]["autoscaling"].update(overrides.pop(pool, {}))
    return {**args, **overrides}


def planner_decisions() -> list[str]:
    """The planner's decisions so far, from the Serve controller's log (where the policy logs them)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return [line.strip() for path in sorted(logs.glob("controller_*.log"))
            for line in path.read_text(errors="replace").splitlines() if "planner: " in line]


def replicas(deployment: str) -> dict[str, tuple[str, int | None]]:
    """Every replica of ``deployment`` the controller knows: id -> (state, pid)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    deployments = details["applications"]["pd"]["deployments"]
    return {r["replica_id"]: (r["state"], r.get("pid")) for r in deployments[deployment]["replicas"]}


def running(deployment: str) -> int:
    return sum(state == "RUNNING" for state, _ in replicas(deployment).values())


class Timeline:
    """Each pool's replica states, sampled every 0.25 s on a thread until stopped."""

    def __init__(self) -> None:
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def _sample(self) -> None:
        sample = {"t": round(time.monotonic() - self.started, 2)}
        for name, deployment in (("prefill", "PrefillServer"), ("decode", "DecodeServer")):
            states = [state for state, _ in replicas(deployment).values()]
            sample[name] = states.count("RUNNING")
            sample[f"{name}_other"] = len(states) - sample[name]
        self.samples.append(sample)

    def changes(self) -> list[dict]:
        """The samples where any count changed: the replica timeline."""
        counts = [{k: v for k, v in sample.items() if k != "t"} for sample in self.samples]
        return [sample for i, sample in enumerate(self.samples) if i == 0 or counts[i] != counts[i - 1]]

    def first(self, predicate, after: float = 0.0) -> float | None:
        return next((s["t"] for s in self.samples if s["t"] >= after and predicate(s)), None)

    def __enter__(self) -> "Timeline":
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        if exc_type is None:
            self._sample()  # the state the caller waited for, which the last tick may have missed


def prefill_capacity(client) -> float:
    """Prompt tokens/s the prefill pool's one replica computes, from its own step times over two prompts.

    Too few steps for the planner to trust (``autoscale.capacity.MIN_SECONDS``), so it does not act on them:
    short prompts (two of the step's would be enough for it). Longer ones run a little slower, so the
    step's high phase asks a little more than its share.
    """
    for seed in range(2):
        prompt = [random.Random(seed).randrange(1000) for _ in range(PROMPT_TOKENS)]
        status, body = client.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert status == 200, body
    [stats] = pool_stats("PrefillServer")
    return stats["num_computed_prompt_tokens"] / stats["prefill_seconds"]


def step_trace(path: Path, capacity: float) -> list[float]:
    """A Mooncake trace of the load step at ``capacity`` prompt tokens/s, every prompt unique; its phases' rates."""
    from bench.trace import TraceRequest, dump_trace

    requests, at, rates = [], 0.0, []
    for duration, share in PHASES:
        rate = share * capacity / STEP_PROMPT_TOKENS
        rates.append(rate)
        end = at + duration
        while at < end - 1e-9:
            first = len(requests) * STEP_PROMPT_TOKENS // PROMPT_TOKENS
            requests.append(TraceRequest(at * 1000, STEP_PROMPT_TOKENS, 4,
                                         tuple(range(first, first + STEP_PROMPT_TOKENS // PROMPT_TOKENS))))
            at += 1 / rate
        at = end
    dump_trace(requests, path)
    return rates


def _prefill_pinned(replica_id: str, token_ids: list[int]):
    """A prefill on that replica whose lease no decode pulls yet: its KV stays pinned there."""
    from ray import serve

    from pd import SamplingParams
    from pd.serve.protocol import PoolRequest, PrefillResult
    from router.protocol import RouteHints

    request_id = f"lease-{uuid.uuid4().hex[:8]}"
    request = PoolRequest(request_id=request_id, token_ids=tuple(token_ids),
                          sampling=SamplingParams(max_tokens=8, temperature=0))
    hints = RouteHints(request_id=request_id, target_replica_id=replica_id)
    data = serve.get_deployment_handle("PrefillServer", "pd").prefill.remote(hints.encode(), request.encode()).result()
    return PrefillResult.decode(data)


def _decode_from(result, token_ids: list[int]) -> tuple[list[int], set]:
    """Continue a prefill on the decode pool from its handle: the tokens and where its KV came from."""
    from ray import serve

    from pd import SamplingParams
    from pd.serve.protocol import DecodeChunk, PoolRequest
    from router.protocol import RouteHints

    request = PoolRequest(request_id=result.request_id, token_ids=tuple(token_ids),
                          sampling=SamplingParams(max_tokens=8, temperature=0), kv_handle=result.kv_handle,
                          first_token_id=result.first_token_id)
    handle = serve.get_deployment_handle("DecodeServer", "pd").options(stream=True)
    tokens, sources = [result.first_token_id], set()
    for data in handle.generate.remote(RouteHints(request_id=request.request_id).encode(), request.encode()):
        chunk = DecodeChunk.decode(data)
        tokens += chunk.token_ids
        sources.add(chunk.kv_source)
    return tokens, sources


def _leases_on_each(offline) -> dict[str, tuple[object, list[int]]]:
    """A pinned lease on every running prefill replica: replica id -> (its prefill result, the prompt)."""
    leases = {}
    for replica_id, (state, _) in replicas("PrefillServer").items():
        if state == "RUNNING":
            token_ids = offline.tokenizer.encode(f"{uuid.uuid4().hex} " + " ".join(f"w{i}" for i in range(120)))
            leases[replica_id] = (_prefill_pinned(replica_id, token_ids), token_ids)
    return leases


def _all_clean() -> bool:
    try:
        stats = pool_stats("PrefillServer") + pool_stats("DecodeServer")
    except Exception:  # a replica starting or stopping
        return False
    return all(s["num_used_blocks"] == 0 and s["num_pinned_leases"] == 0 and s["num_running"] == 0 for s in stats)


def _going_away(deployment: str) -> tuple[str, int]:
    """The one replica of ``deployment`` that is stopping, once there is one: (id, pid)."""
    [(replica_id, (_, pid))] = wait_until(
        lambda: [(rid, info) for rid, info in replicas(deployment).items() if info[0] == "STOPPING"], timeout=60)
    return replica_id, pid


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
        locust = threading.Thread(target=lambda: setattr(locust, "done", _locust(
            client.url, run_dir / "locust", "--trace-file", str(tmp_path / "step.jsonl"), "--max-tokens", "4",
            "--slo-ttft-ms", "5000", "-u", "1", "-r", "1", "--run-time", "120s", timeout=200)))
        locust.start()
        try:
            scaled_out = wait_until(lambda: timeline.first(lambda s: s["prefill"] == 2), timeout=60)
        except TimeoutError:
            raise AssertionError(f"no scale-out at {rates} requests/s, capacity {capacity:.0f} tokens/s") from None
        # Once the load drops, both replicas get a lease no decode has pulled: the one going away must
        # keep serving its KV until the lease ends.
        high_ends = timeline.started + PHASES[0][0] + PHASES[1][0]
        wait_until(lambda: time.monotonic() >= high_ends and running("PrefillServer") == 2, timeout=60)
        leases = _leases_on_each(offline)
        assert len(leases) == 2, leases
        replica_id, _ = _going_away("PrefillServer")
        # Serve's own drain (no calls in flight, checked every 2 s) is over well before this: only the
        # lease keeps the replica up now.
        stopping_since = time.monotonic()
        while time.monotonic() - stopping_since < 3 * SERVE_DRAIN_LOOP_S:
            assert replica_id in replicas("PrefillServer"), "exited while its lease was pinned"
            time.sleep(0.25)
        result, token_ids = leases[replica_id]
        tokens, sources = _decode_from(result, token_ids)
        locust.join(200)
        wait_until(lambda: replicas("PrefillServer").keys() == {rid for rid in leases if rid != replica_id},
                   timeout=60)
    from pd.engine.request import KVSource
    from tests.serve.test_app_loadtest import _stats

    assert sources == {KVSource.REMOTE}, sources  # pulled from the draining replica, not recomputed
    assert tokens == offline(token_ids, 8)
    for other_id, (other, other_ids) in leases.items():
        if other_id != replica_id:
            assert _decode_from(other, other_ids)[0] == offline(other_ids, 8)
    done = locust.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stats = _stats(run_dir / "locust")
    assert sum(int(row["Failure Count"]) for row in stats.values()) == 0
    num_requests = sum(int(row["Request Count"]) for (kind, _), row in stats.items() if kind == "E2E")
    assert num_requests == num_requests_sent
    # What the decode replica did: prompt tokens it computed itself (overflow, or a pull given up: 0
    # when all went well), and its pulls.
    counters = {"computed_prompt_tokens": "num_computed_prompt_tokens", "pulls": "num_remote_pulls",
                "pull_seconds": "pull_seconds_total"}
    decode_work = [{name: round(now[key] - decode_before[key], 2) for name, key in counters.items()}
                   for now in pool_stats("DecodeServer")]
    scaled_in = timeline.first(lambda s: s["prefill"] == 1 and s["prefill_other"] == 0, after=scaled_out)
    print(json.dumps({"prefill_capacity_tokens_per_s": round(capacity), "rates_per_s": [round(r, 2) for r in rates],
                      "load_step_at_s": step_at, "prefill_2_at_s": scaled_out, "prefill_back_to_1_at_s": scaled_in,
                      "decode": decode_work, "max_decode": max(s["decode"] + s["decode_other"] for s in timeline.samples),
                      "timeline": timeline.changes()}))
    assert scaled_out - step_at <= 30.0
    assert all(s["decode"] + s["decode_other"] == 1 for s in timeline.samples), \
        "\n".join([*planner_decisions(), f"decode: {decode_work}"])
    wait_until(_all_clean, timeout=30)


class PacedLoad:
    """One unique 512-token prompt streamed every ``gap_s`` on a thread until stopped; each stream's outcome."""

    def __init__(self, client, gap_s: float = 1.0) -> None:
        self.client, self.gap_s = client, gap_s
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from tests.serve.test_faults import _judge

        rng = random.Random(uuid.uuid4().int)
        while not self._stop.wait(self.gap_s):
            prompt = [rng.randrange(1000) for _ in range(PROMPT_TOKENS)]
            status, text = self.client.request("POST", "/v1/completions", {
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": True})
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            self.outcomes.append(_judge(events) if status == 200 else f"status {status}")

    def __enter__(self) -> "PacedLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "a stream hung"


def test_the_draining_prefill_replica_killed_loses_no_request(ray_cluster, offline):
    """Two prefill replicas and light load: the planner scales to one; the one going away dies while it drains."""
    from pd.engine.request import KVSource

    # Idle from the start, the planner wants one replica at once: the delay leaves time to see two.
    ensure_app("autoscaling.yaml", **planner_app(prefill={"initial_replicas": 2, "slo_ttft_s": 2.0,
                                                          "scale_down_delay_s": 25.0}))
    client = Client(ray_cluster["url"])
    wait_until(lambda: running("PrefillServer") == 2, timeout=90)
    leases = _leases_on_each(offline)
    with PacedLoad(client) as load:
        replica_id, pid = _going_away("PrefillServer")
        os.kill(pid, signal.SIGKILL)
        result, token_ids = leases[replica_id]
        tokens, sources = _decode_from(result, token_ids)
        wait_until(lambda: len(load.outcomes) >= 4, timeout=60)
    assert sources == {KVSource.RECOMPUTE}, sources  # its KV went with it: recomputed, never garbage
    assert tokens == offline(token_ids, 8)
    assert set(load.outcomes) == {"done"}, load.outcomes
    for other_id, (other, other_ids) in leases.items():
        if other_id != replica_id:
            assert _decode_from(other, other_ids)[0] == offline(other_ids, 8)
    wait_until(lambda: running("PrefillServer") == 1 and len(replicas("PrefillServer")) == 1, timeout=60)
    wait_until(_all_clean, timeout=30)


def _long_stream(client, index: int, max_tokens: int) -> str:
    from tests.serve.test_faults import _stream

    return _stream(client, f"stream {index} {uuid.uuid4().hex}", max_tokens)


def test_decode_scaled_down_under_long_streams_moves_them_and_breaks_none(ray_cluster):
    """Two decode replicas and a few streams longer than the graceful window: the one going away is stopped
    mid-stream, and its streams move to the other replica and finish."""
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
        # Streams of 1,000 tokens last about 20 s here; the scale-down comes 6-8 s in, and the replica is
        # stopped 1 s later. 500 tokens were too few on a faster machine: they finished inside the
        # graceful window and nothing moved.
        streams = [pool.submit(_long_stream, client, i, 1000) for i in range(4)]
        busy = {}  # replica id -> streams running on it, sampled until one replica is going away
        going = wait_until(lambda: busy.update(_running_streams())
                           or [rid for rid, (state, _) in replicas("DecodeServer").items() if state == "STOPPING"],
                           timeout=60)
        outcomes = [stream.result(timeout=180) for stream in streams]
    assert outcomes == ["done"] * 4, outcomes
    [gone] = going
    assert busy.get(gone, 0) > 0, busy  # it was stopped with streams on it...
    assert _ingress_stats()["num_migrations"] > migrations_before  # ...which moved
    wait_until(lambda: running("DecodeServer") == 1 and len(replicas("DecodeServer")) == 1, timeout=60)
    wait_until(_all_clean, timeout=30)


def _running_streams() -> dict[str, int]:
    """Streams on each running decode replica that answers within 5 s (one may be leaving the routers)."""
    from ray import serve

    from router.protocol import RouteHints

    handle = serve.get_deployment_handle("DecodeServer", "pd")
    counts = {}
    for replica_id, (state, _) in replicas("DecodeServer").items():
        if state == "RUNNING":
            call = handle.stats_of.remote(RouteHints(request_id="", target_replica_id=replica_id).encode())
            try:
                counts[replica_id] = call.result(timeout_s=5)["num_running"]
            except Exception:  # noqa: BLE001 - it left the routers between the two reads
                call.cancel()
    return counts


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
