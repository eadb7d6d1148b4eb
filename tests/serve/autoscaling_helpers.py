"""What the planner tests on a real app share: the app's args, the pools' replicas, leases pinned on them, load.

``tests/serve/test_autoscaling.py`` runs the tests; this module starts nothing by itself.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from pathlib import Path

from tests.serve.conftest import pool_stats, wait_until

PERIOD_S = 2.0
SCALE_DOWN_DELAY_S = 6.0
MODEL = "builtin:tiny-llama"
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
    from pd.workload.trace import TraceRequest, dump_trace

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


def prefill_pinned(replica_id: str, token_ids: list[int]):
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


def decode_from(result, token_ids: list[int]) -> tuple[list[int], set]:
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


def leases_on_each(offline) -> dict[str, tuple[object, list[int]]]:
    """A pinned lease on every running prefill replica: replica id -> (its prefill result, the prompt)."""
    leases = {}
    for replica_id, (state, _) in replicas("PrefillServer").items():
        if state == "RUNNING":
            token_ids = offline.tokenizer.encode(f"{uuid.uuid4().hex} " + " ".join(f"w{i}" for i in range(120)))
            leases[replica_id] = (prefill_pinned(replica_id, token_ids), token_ids)
    return leases


def all_clean() -> bool:
    try:
        stats = pool_stats("PrefillServer") + pool_stats("DecodeServer")
    except Exception:  # a replica starting or stopping
        return False
    return all(s["num_used_blocks"] == 0 and s["num_pinned_leases"] == 0 and s["num_running"] == 0 for s in stats)


def going_away(deployment: str) -> tuple[str, int]:
    """The one replica of ``deployment`` that is stopping, once there is one: (id, pid)."""
    [(replica_id, (_, pid))] = wait_until(
        lambda: [(rid, info) for rid, info in replicas(deployment).items() if info[0] == "STOPPING"], timeout=60)
    return replica_id, pid


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


def long_stream(client, index: int, max_tokens: int, enough: threading.Event, more_events: int = 16) -> str:
    """A greedy stream read as it comes: 'done' at its end, 'error' or 'broken' as ``test_faults._judge`` says,
    or 'cut': ``enough`` was set and ``more_events`` events came after it, none an error; the client then
    disconnects, as a user who has read enough does."""
    import http.client
    import json
    import urllib.parse

    from tests.serve.test_faults import _judge

    url = urllib.parse.urlsplit(client.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "model": MODEL, "prompt": f"stream {index} {uuid.uuid4().hex}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return "error" if response.status in (429, 500, 503) else "broken"
        events, enough_at = [], None
        for line in response:
            if not line.startswith(b"data: "):
                continue
            events.append(line[6:].decode().strip())
            if events[-1] == "[DONE]" or "error" in json.loads(events[-1]):
                break
            if enough.is_set():
                enough_at = len(events) if enough_at is None else enough_at
                if len(events) - enough_at >= more_events:
                    return "cut"
        return _judge(events)
    finally:
        conn.close()


def running_streams() -> dict[str, int]:
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
