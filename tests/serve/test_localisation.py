"""A request slowed by a fault shows where: its ``/debug/requests`` timeline puts the excess in the fault's span.

The default app (one prefill, one decode replica). A LONG prompt is
prefilled on the prefill pool; a SHORT one on its decode replica. A slow
replica is made slow for real: stopped and resumed on a duty cycle
(``SIGSTOP``/``SIGCONT``, ``bench.gray_isolation.DutyCycle``). A
stalled transfer is the decode replica's every KV read posted late
(``PD_FAULT_KV_PULL_DELAY_S``, ``transfer.base.DelayedRead``): the engine
waits on the pull while it steps its other requests.

Destructive (a stopped process): runs last.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import uuid
from typing import Iterator

import pytest

from bench.gray_isolation import DutyCycle
from pd.engine.disagg.connector import FAULT_PULL_DELAY_ENV
from tests.serve.conftest import Client, ensure_app, pool_stats
from tests.serve.test_debug_requests import _call, _timeline

pytestmark = pytest.mark.destructive

MODEL = "builtin:tiny-llama"
LONG = " ".join(f"word{i}" for i in range(400))
# Past the remote-prefill threshold (256 tokens), and short: the stall is then not lost in the prefill's own noise
MEDIUM = " ".join(f"word{i}" for i in range(120))
CASES = {  # the slow pool, a prompt that runs there, its tokens, and the span that must hold the excess
    "prefill": ("PrefillServer", lambda: f"{uuid.uuid4().hex} {LONG}", 2, "prefill"),
    "decode": ("DecodeServer", lambda: f"{uuid.uuid4().hex} tell me about the sea", 48, "decode"),
    "transfer": ("DecodeServer", lambda: f"{uuid.uuid4().hex} {MEDIUM}", 2, "decode.kv_pull"),
}
STALL_S = 0.4
STALLED_DECODE = {"num_replicas": 1, "max_ongoing_requests": 64, "max_queued_requests": 128,
                  "ray_actor_options": {"num_cpus": 0.5,
                                        "runtime_env": {"env_vars": {FAULT_PULL_DELAY_ENV: str(STALL_S)}}}}


@contextlib.contextmanager
def _fault(case: str, client: Client, deployment: str) -> Iterator[None]:
    """The slow replica (stopped and resumed on a duty cycle), or every KV read posted ``STALL_S`` late."""
    if case == "transfer":
        ensure_app("default.yaml", decode=STALLED_DECODE)
        _timed(client, CASES[case][1](), 2)  # the new decode replica warm
        yield
        return
    [replica] = pool_stats(deployment)
    with DutyCycle(replica["pid"]):
        yield


def _timed(client: Client, prompt: str, max_tokens: int) -> dict:
    status, _, text = _call(f"{client.url}/v1/completions", "POST", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert status == 200, text
    return _timeline(client, json.loads(text)["id"])


def _in(timeline: dict, name: str) -> float:
    return sum(span["duration_s"] or 0.0 for span in timeline["spans"] if span["name"] == name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_excess_time_of_a_slow_replica_is_in_its_span(ray_cluster, case):
    deployment, prompt, max_tokens, span = CASES[case]
    ensure_app("default.yaml")
    client = Client(ray_cluster["url"])
    _timed(client, prompt(), max_tokens)  # both pools warm
    baseline = [_timed(client, prompt(), max_tokens) for _ in range(3)]
    with _fault(case, client, deployment):
        slowed = [_timed(client, prompt(), max_tokens) for _ in range(3)]
    excess = statistics.median(t["duration_s"] for t in slowed) - statistics.median(t["duration_s"] for t in baseline)
    in_span = statistics.median(_in(t, span) for t in slowed) - statistics.median(_in(t, span) for t in baseline)
    print(json.dumps({"case": case, "excess_s": round(excess, 4), "in_span_s": round(in_span, 4),
                      "share": round(in_span / excess, 3)}))
    assert excess > 0.05, (excess, baseline[0], slowed[0])
    assert in_span / excess > 0.8, (in_span, excess, slowed[0])
