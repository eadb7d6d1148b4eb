"""Flow control served: an app whose pools are full holds or sheds before any compute, as a client sees it.

The app is ``default.yaml`` with ``flow_control:`` set so that the pools count
as full whenever a request is in flight (``max_waiting: 0``): one request at
a time is admitted once the replicas have reported. Tenant ``c`` may queue
none (``max_queued: 0``), so its requests beyond the first are shed with 429;
tenant ``a``'s request waits for the place and is served.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

import pytest

from tests.serve.conftest import Client, ensure_app, wait_until

FLOW_CONTROL = {
    "bands": [{"name": "interactive", "min_priority": 0, "max_priority": 0, "ttft_deadline_ms": 60000},
              {"name": "batch", "min_priority": 1}],
    "tenants": {"a": {"api_keys": ["sk-test-a"]}, "c": {"api_keys": ["sk-test-c"], "max_queued": 0}},
    "default_tenant": "a",
    "saturation": {"max_waiting": 0, "max_report_age_s": 30},
}
LONG = {"model": "builtin:tiny-llama", "prompt": "count to a thousand", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def app(ray_cluster):
    ensure_app("default.yaml", flow_control=FLOW_CONTROL)
    return Client(ray_cluster["url"])


def ingress_flow() -> dict:
    from ray import serve

    return serve.get_app_handle("pd").process_stats.remote().result()["flow"]


def post(url: str, body: dict, key: str) -> tuple[int, Any, dict]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def test_a_full_app_sheds_a_tenant_over_its_queue_bound_with_429_and_serves_the_waiting(app):
    status, _, _ = post(app.url, {**LONG, "max_tokens": 2}, "sk-test-a")
    assert status == 200
    wait_until(lambda: ingress_flow()["limit"] is not None, timeout=60)  # the replicas have reported
    first = {}
    holder = threading.Thread(target=lambda: first.update(answer=post(app.url, LONG, "sk-test-c")))
    holder.start()
    wait_until(lambda: ingress_flow()["in_flight"] == 1, timeout=30)
    status, headers, body = post(app.url, {**LONG, "max_tokens": 4}, "sk-test-c")
    assert status == 429, body
    assert body["error"]["code"] == "tenant_queue" and body["error"]["type"] == "rate_limit_error"
    assert "tenant's requests are waiting" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    request_id = body["error"]["request_id"]
    status, timeline = app.request("GET", f"/debug/requests/{request_id}",
                                   headers={"Authorization": "Bearer sk-test-a"})
    timeline = json.loads(timeline)
    assert timeline["status"] == "shed" and timeline["attributes"]["shed"] == "tenant_queue"
    assert not any(span["name"].startswith(("prefill", "decode")) for span in timeline["spans"])  # no compute
    waited = {}
    waiter = threading.Thread(target=lambda: waited.update(answer=post(app.url, {**LONG, "max_tokens": 4},
                                                                         "sk-test-a")))
    waiter.start()
    wait_until(lambda: ingress_flow()["waiting"] == 1, timeout=30)  # a's request waits for the place
    flow = ingress_flow()  # and the stats say why: the decode pool, which serves it, is full (max_waiting 0)
    assert "decode" in flow["full_pools"] and flow["stale_pools"] == [], flow
    holder.join(120)
    waiter.join(120)
    assert first["answer"][0] == 200 and first["answer"][2]["usage"]["completion_tokens"] == 400
    assert waited["answer"][0] == 200 and waited["answer"][2]["usage"]["completion_tokens"] == 4
    flow = ingress_flow()
    assert flow["shed"] == {"c/interactive/tenant_queue": 1} and flow["in_flight"] == 0 and flow["waiting"] == 0


def test_a_bad_deadline_header_or_priority_is_a_400_naming_it(app):
    status, body = app.post("/v1/completions", {**LONG, "max_tokens": 2},
                            headers={"Authorization": "Bearer sk-test-a", "x-slo-ttft-ms": "soon"})
    assert status == 400 and body["error"]["param"] == "x-slo-ttft-ms"
    status, body = app.post("/v1/completions", {**LONG, "max_tokens": 2, "priority": -5},
                            headers={"Authorization": "Bearer sk-test-a"})
    assert status == 400 and body["error"]["param"] == "priority" and "no priority band" in body["error"]["message"]
    status, body = app.post("/v1/completions", {**LONG, "max_tokens": 2}, headers={"Authorization": "Bearer nope"})
    assert status == 401
