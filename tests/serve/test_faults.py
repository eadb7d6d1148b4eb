"""Faults under load: broken transfers and replica deaths. No hangs, no garbage, no leaked blocks or leases.

Destructive: these run last (see tests/conftest.py), on their own app.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass

import pytest

from tests.serve.conftest import ensure_app, pool_stats, replica_ids, wait_until

MODEL = "builtin:tiny-llama"
LONG = " ".join(f"word{i}" for i in range(150))
FAULT_APP = {"prefill_timeout_s": 4.0}

pytestmark = pytest.mark.destructive


@dataclass(frozen=True)
class Streamed:
    outcome: str  # as _stream says
    long: bool  # prefilled remotely when the prefill pool is up
    started: float  # time.monotonic()
    ttft: float | None  # seconds to the first data event


def _timed_stream(client, prompt: str, max_tokens: int) -> Streamed:
    """A streamed completion read as it arrives: its outcome and its time to first token."""
    parts = urllib.parse.urlsplit(client.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    started, ttft, events = time.monotonic(), None, []
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return Streamed("error" if response.status in (429, 500, 503) else "broken", LONG in prompt, started, None)
        for line in response:
            if line.startswith(b"data: "):
                ttft = ttft if ttft is not None else time.monotonic() - started
                events.append(line[6:].strip().decode())
    finally:
        conn.close()
    return Streamed(_judge(events), LONG in prompt, started, ttft)


def _judge(events: list[str]) -> str:
    if events and events[-1] == "[DONE]":
        # ignore_eos: a whole answer runs to max_tokens and says so.
        last = json.loads(events[-2]) if len(events) > 1 else {}
        finished = last.get("choices") and last["choices"][0]["finish_reason"] == "length"
        return "done" if finished else "broken"
    return "error" if events and "error" in json.loads(events[-1]) else "broken"


def _stream(client, prompt: str, max_tokens: int) -> str:
    """'done', 'error' (an error event ended the stream) or 'broken' (anything else)."""
    status, text = client.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True,
    })
    if status != 200:
        return "error" if status in (429, 500, 503) else "broken"
    return _judge([line[6:] for line in text.splitlines() if line.startswith("data: ")])


class Load:
    """About 8 streams in flight until stopped; records each stream's outcome."""

    def __init__(self, client, num_streams: int = 8, max_tokens: int = 24, long_only: bool = False):
        self.client, self.max_tokens, self.long_only = client, max_tokens, long_only
        self.streams: list[Streamed] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_streams)]

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            if self.long_only or index % 2 == 0:
                # A prefix no cache holds: it prefills remotely whenever the prefill pool is up.
                prompt = f"{uuid.uuid4().hex} {LONG}"
            else:
                prompt = f"short prompt {index}"
            self.streams.append(_timed_stream(self.client, prompt, self.max_tokens))

    @property
    def outcomes(self) -> list[str]:
        return [stream.outcome for stream in self.streams]

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
    """``kill -9`` the pool's one replica process, as a crash would."""
    [stats] = pool_stats(deployment)
    os.kill(stats["pid"], signal.SIGKILL)
    return stats["replica_id"]


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


def _dead_nixl_peer(real_metadata: bytes) -> bytes:
    """The real prefill pool's metadata, but naming a NIXL agent whose process has exited."""
    from transfer.nixl_backend import NixlPeer

    script = (
        "import sys, torch\n"
        "from transfer import create_transport\n"
        "t = create_transport('nixl', sys.argv[1])\n"
        "t.register(torch.zeros(4, 64))\n"
        "print('METADATA', t.local_metadata().hex())\n"
    )
    done = subprocess.run([sys.executable, "-c", script, f"gone-{uuid.uuid4().hex[:8]}"], capture_output=True,
                          text=True, timeout=120, check=True)
    [line] = [line for line in done.stdout.splitlines() if line.startswith("METADATA ")]
    dead = NixlPeer.decode(bytes.fromhex(line.split()[1]))
    return NixlPeer.decode(real_metadata).replace(name=dead.name, agent_metadata=dead.agent_metadata).encode()


def _flip_middle_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    return bytes(flipped)


def _broken_handle(kind: str, handle: bytes, other_prompts_handle: bytes) -> bytes:
    """``handle`` broken the way ``kind`` says."""
    from transfer.wire import KVHandle

    if kind == "truncated":
        return handle[: len(handle) // 2]
    if kind == "flipped-byte":
        return _flip_middle_byte(handle)
    if kind == "another-prompt-same-length":
        return other_prompts_handle
    real = KVHandle.decode(handle)
    if kind == "fingerprint-mismatch":
        fingerprint = real.fingerprint.replace(num_layers=real.fingerprint.num_layers + 1)
        return real.replace(fingerprint=fingerprint).encode()
    assert kind == "unreachable-peer", kind
    return real.replace(engine_id="gone-peer", peer_metadata=_dead_nixl_peer(real.peer_metadata)).encode()


BREAKS = ("truncated", "flipped-byte", "fingerprint-mismatch", "another-prompt-same-length", "unreachable-peer")


def test_broken_transfers_recompute_the_colocated_tokens(fault_app, offline):
    """Every way a handle can go bad ends in a local recompute with the colocated greedy output."""
    from ray import serve

    from pd import SamplingParams
    from pd.engine.request import KVSource
    from pd.serve.protocol import DecodeChunk, PoolControl, PoolRequest, PrefillResult
    from router.protocol import RouteHints

    token_ids = offline.tokenizer.encode(LONG)
    other_ids = list(token_ids)
    other_ids[5], other_ids[6] = token_ids[6], token_ids[5]  # another prompt of the same length
    assert other_ids != token_ids
    expected = offline(token_ids, 8)
    params = SamplingParams(max_tokens=8, temperature=0)
    prefill = serve.get_deployment_handle("PrefillServer", "pd")
    decode = serve.get_deployment_handle("DecodeServer", "pd").options(stream=True)

    def prefilled(request_id: str, ids: list[int]) -> PrefillResult:
        request = PoolRequest(request_id=request_id, token_ids=tuple(ids), sampling=params)
        return PrefillResult.decode(prefill.prefill.remote(RouteHints(request_id=request_id).encode(),
                                                           request.encode()).result())

    def release(result: PrefillResult) -> None:
        hints = RouteHints(request_id=result.request_id, target_replica_id=result.replica_id)
        prefill.release.remote(hints.encode(), PoolControl(request_id=result.request_id).encode()).result()

    fallbacks_before = sum(s["num_recompute_fallbacks"] for s in pool_stats("DecodeServer"))
    with Load(fault_app, num_streams=6) as load:
        for kind in BREAKS:
            real, other = prefilled(f"break-{kind}", token_ids), prefilled(f"other-{kind}", other_ids)
            broken = _broken_handle(kind, real.kv_handle, other.kv_handle)
            request = PoolRequest(request_id=f"break-{kind}", token_ids=tuple(token_ids), sampling=params,
                                  kv_handle=broken, first_token_id=real.first_token_id)
            tokens, paths = [real.first_token_id], set()
            for data in decode.generate.remote(RouteHints(request_id=request.request_id).encode(), request.encode()):
                chunk = DecodeChunk.decode(data)
                tokens += chunk.token_ids
                paths.add(chunk.kv_source)
            assert tokens == expected, kind
            assert paths == {KVSource.RECOMPUTE}, (kind, paths)
            release(real)
            release(other)
    assert load.outcomes and set(load.outcomes) == {"done"}, load.outcomes
    assert sum(s["num_recompute_fallbacks"] for s in pool_stats("DecodeServer")) >= fallbacks_before + len(BREAKS)
    wait_until(_all_clean, timeout=30)


def test_killing_the_prefill_replica_under_load(fault_app):
    """Every stream completes, and no first token waits more than twice its no-fault time plus 2 s."""
    with Load(fault_app, long_only=True) as load:
        wait_until(lambda: len(load.streams) >= 8, timeout=90)
        baseline = list(load.streams)
        killed = _kill("PrefillServer")
        wait_until(lambda: replica_ids("pd", "PrefillServer") and replica_ids("pd", "PrefillServer") != [killed],
                   timeout=60)
        before = len(load.streams)
        wait_until(lambda: len(load.streams) >= before + 8, timeout=90)
    faulted = load.streams[len(baseline):]
    assert {s.outcome for s in load.streams} == {"done"}, load.outcomes
    no_fault, worst = max(s.ttft for s in baseline), max(s.ttft for s in faulted)
    print(json.dumps({"prefill_killed": True, "no_fault_ttft_max_s": round(no_fault, 3),
                      "no_fault_ttft_median_s": round(statistics.median(s.ttft for s in baseline), 3),
                      "faulted_ttft_max_s": round(worst, 3), "bound_s": round(2 * no_fault + 2, 3)}))
    assert worst <= 2 * no_fault + 2.0, (worst, no_fault)
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
    served = [elapsed for status, elapsed in results if status == 200]
    assert refused and served, results
    assert len(refused) + len(served) == len(results), results
    # Refused at once, not after queueing: a queued request waits at least as long as one served. Bounded by
    # the fastest served request too, so that a host busy with other work, which slows both, fails neither.
    assert max(refused) < max(5.0, min(served)), results
    wait_until(_all_clean, timeout=30)


def _stream_tokens(prompt: list[int], max_tokens: int, results: dict, key: int) -> None:
    """A greedy stream through the handle API (token ids): every token, or the exception that ended it."""
    from ray import serve

    from pd.serve import GenerateRequest

    request = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        chunks = serve.get_app_handle("pd").options(stream=True).generate.remote(request)
        results[key] = [t for chunk in chunks for t in chunk.token_ids]
    except Exception as exc:  # noqa: BLE001 - recorded: the test says which stream broke and how
        results[key] = exc


def test_streams_survive_the_death_of_their_decode_replica(ray_cluster, offline, hf_model):
    """Two decode replicas, eight greedy streams, one replica killed: every stream completes, unchanged.

    A moved stream recomputes its KV as a prefill; fp32 on CPU is not batch-invariant, so its first
    divergence from the uninterrupted run, if any, is forgiven only at a near-tie of the reference.
    """
    from tests.serve.conftest import Client

    ensure_app("default.yaml", **FAULT_APP, decode={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}})
    client = Client(ray_cluster["url"])
    wait_until(lambda: _serves_again(client), timeout=60)
    prompts = [offline.tokenizer.encode(f"{uuid.uuid4().hex} {LONG}" if i % 2 == 0 else f"short {uuid.uuid4().hex}")
               for i in range(8)]
    max_tokens = 64
    expected = [offline(p, max_tokens) for p in prompts]
    migrations_before = _ingress_stats()["num_migrations"]
    results: dict = {}
    threads = [threading.Thread(target=_stream_tokens, args=(p, max_tokens, results, i)) for i, p in enumerate(prompts)]
    for thread in threads:
        thread.start()
    busiest = wait_until(lambda: _busiest_decode_replica(min_running=2), timeout=60)
    os.kill(busiest["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    for prompt, want, key in zip(prompts, expected, range(8)):
        got = results.get(key)
        assert isinstance(got, list) and len(got) == max_tokens, (key, got)
        _assert_equal_up_to_a_near_tie(hf_model, prompt, got, want)
    assert _ingress_stats()["num_migrations"] - migrations_before >= 2
    wait_until(lambda: len(replica_ids("pd", "DecodeServer")) == 2, timeout=90)
    wait_until(_all_clean, timeout=30)


def _assert_equal_up_to_a_near_tie(hf_model, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal greedy tokens, or a first divergence where the reference's top-2 logit gap is below 1e-4."""
    import torch

    from pd.model.paths import resolve_model_path

    diverged = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if diverged is None:
        return
    model = hf_model(str(resolve_model_path(MODEL)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:diverged]])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-4, f"diverged at token {diverged} with a top-2 gap of {gap:.3g}: not a near-tie"


def _busiest_decode_replica(min_running: int) -> dict | None:
    stats = [s for s in pool_stats("DecodeServer") if s["num_running"] >= min_running]
    return max(stats, key=lambda s: s["num_running"], default=None)


def _ingress_stats() -> dict:
    from ray import serve

    return serve.get_app_handle("pd").process_stats.remote().result()
