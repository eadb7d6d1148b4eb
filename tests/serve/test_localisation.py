"""A request slowed by a slow replica shows where: its ``/debug/requests`` timeline puts the excess in that span.

The default app (one prefill, one decode replica). A LONG prompt is
prefilled on the prefill pool; a SHORT one on its decode replica. The
replica is made slow for real: stopped and resumed on a duty cycle
(``SIGSTOP``/``SIGCONT``, ``tests/serve/test_gray_failure.DutyCycle``).

Destructive (a stopped process): runs last.
"""

from __future__ import annotations

import json
import statistics
import uuid

import pytest

from tests.serve.conftest import Client, ensure_app, pool_stats
from tests.serve.test_debug_requests import _call, _timeline
from tests.serve.test_gray_failure import DutyCycle

pytestmark = pytest.mark.destructive

MODEL = "builtin:tiny-llama"
LONG = " ".join(f"word{i}" for i in range(400))
CASES = {  # the slow pool, a prompt that runs there, its tokens, and the span that must hold the excess
    "prefill": ("PrefillServer", lambda: f"{uuid.uuid4().hex} {LONG}", 2, "prefill"),
    "decode": ("DecodeServer", lambda: f"{uuid.uuid4().hex} tell me about the sea", 48, "decode"),
}


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
    [replica] = pool_stats(deployment)
    with DutyCycle(replica["pid"]):
        slowed = [_timed(client, prompt(), max_tokens) for _ in range(3)]
    excess = statistics.median(t["duration_s"] for t in slowed) - statistics.median(t["duration_s"] for t in baseline)
    in_span = statistics.median(_in(t, span) for t in slowed) - statistics.median(_in(t, span) for t in baseline)
    print(json.dumps({"case": case, "excess_s": round(excess, 4), "in_span_s": round(in_span, 4),
                      "share": round(in_span / excess, 3)}))
    assert excess > 0.05, (excess, baseline[0], slowed[0])
    assert in_span / excess > 0.8, (in_span, excess, slowed[0])
