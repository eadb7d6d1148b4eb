"""Who sent a request and how urgent it is: flow control's settings, checked, and a request classified by them."""

from __future__ import annotations

import math

import pytest

from router.flow_config import (
    Band,
    FlowConfig,
    FlowIdentity,
    FlowRequestError,
    SaturationConfig,
    Tenant,
    key_digest,
)

BANDS = (Band("interactive", None, 0, 2.0), Band("standard", 1, 4, 10.0), Band("batch", 5, None))
CONFIG = FlowConfig(
    bands=BANDS,
    tenants=(Tenant("a"), Tenant("b", default_priority=5), Tenant("c", weight=2.0)),
    default_tenant="a",
    trust_tenant_header=True,
    key_tenants={key_digest("sk-a"): "a", key_digest("sk-b"): "b"},
)


def classify(config: FlowConfig = CONFIG, **identity):
    return config.classify("r1", FlowIdentity(**identity), 100, 50, 7.0)


def test_the_tenant_comes_from_the_key_else_a_trusted_header_else_the_default():
    assert classify(api_key="sk-b").tenant == "b"
    assert classify(api_key="sk-b", tenant_header="c").tenant == "b"  # the key wins
    assert classify(tenant_header="c").tenant == "c"
    assert classify(api_key="sk-unknown", tenant_header="c").tenant == "c"  # an app key that names no tenant
    assert classify().tenant == "a"
    untrusted = FlowConfig(bands=BANDS, tenants=CONFIG.tenants, default_tenant="a", key_tenants=CONFIG.key_tenants)
    assert classify(untrusted, tenant_header="c").tenant == "a"  # an untrusted header is ignored


def test_an_unknown_tenant_header_is_refused_naming_the_header():
    with pytest.raises(FlowRequestError, match="x-tenant-id: unknown tenant 'zed'") as refused:
        classify(tenant_header="zed")
    assert refused.value.field == "x-tenant-id" and refused.value.status == 400


def test_priority_band_and_deadline():
    request = classify(priority=3)
    assert (request.priority, request.band, request.deadline_s) == (3, 1, 10.0)
    assert classify(api_key="sk-b").priority == 5 and classify(api_key="sk-b").band == 2  # b's default
    assert classify(priority=-7).band == 0 and classify(priority=10**6).band == 2
    batch = classify(priority=9)
    assert batch.deadline_s is None and batch.deadline_at_s == math.inf
    request = classify(priority=9, slo_ttft_header="1500")
    assert request.deadline_s == 1.5 and request.deadline_at_s == 8.5
    assert classify(slo_ttft_header=" 250.5 ").deadline_s == pytest.approx(0.2505)
    assert (request.cost, request.num_prompt_tokens, request.max_output_tokens) == (150, 100, 50)


@pytest.mark.parametrize("header", ["fast", "0", "-5", "nan", "inf", "", "1e999"])
def test_a_bad_deadline_header_is_refused_naming_it(header):
    with pytest.raises(FlowRequestError, match="x-slo-ttft-ms") as refused:
        classify(slo_ttft_header=header)
    assert refused.value.field == "x-slo-ttft-ms"


def test_a_priority_in_no_band_or_not_an_integer_is_refused():
    gappy = FlowConfig(bands=(Band("interactive", None, 0), Band("batch", 5, None)))
    with pytest.raises(FlowRequestError, match=r"priority: 3 is in no priority band \(interactive \[-inf, 0\], "
                                               r"batch \[5, inf\]\)"):
        classify(gappy, priority=3)
    for bad in (True, 1.5, "1"):
        with pytest.raises(FlowRequestError, match="priority: must be an integer"):
            classify(priority=bad)


@pytest.mark.parametrize("changes, message", [
    ({"bands": ()}, "at least one band"),
    ({"bands": (Band("x", None, 5), Band("y", 3, None))}, "overlap or are out of order"),
    ({"bands": (Band("x", 5, None), Band("y", None, 3))}, "overlap or are out of order"),
    ({"bands": (Band("x", None, 0), Band("x", 1, None))}, "'x' is named twice"),
    ({"tenants": (Tenant("a"), Tenant("a"))}, "'a' is named twice"),
    ({"default_tenant": "zed"}, "default_tenant 'zed' is not a tenant"),
    ({"tenants": (Tenant("a", default_priority=7),), "bands": (Band("only", None, 0),)},
     "default_priority 7 is in no band"),
    ({"key_tenants": {key_digest("k"): "zed"}}, "not configured: zed"),
    ({"shed_margin": -0.1}, "shed_margin"),
    ({"shed_margin": math.nan}, "shed_margin"),
    ({"max_queued": -1}, "max_queued"),
    ({"queue_reserve": 1.0}, "queue_reserve"),
    ({"queue_reserve": -0.1}, "queue_reserve"),
])
def test_settings_that_do_not_hold_together_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        FlowConfig(**{"tenants": (Tenant("a"),), "default_tenant": "a", **changes})


@pytest.mark.parametrize("make, message", [
    (lambda: Tenant("a", weight=0.0), "weight must be > 0"),
    (lambda: Tenant("a", weight=math.inf), "weight must be > 0"),
    (lambda: Tenant("a", quota_tokens_per_min=0), "quota_tokens_per_min"),
    (lambda: Tenant("a", max_queued=-1), "max_queued"),
    (lambda: Band("b", 3, 1), "min_priority 3 is above max_priority 1"),
    (lambda: Band("b", ttft_deadline_s=0.0), "ttft_deadline_s must be > 0"),
    (lambda: SaturationConfig(max_kv_usage=1.5), "max_kv_usage"),
    (lambda: SaturationConfig(max_report_age_s=0.0), "max_report_age_s"),
    (lambda: SaturationConfig(max_waiting=-1), "max_waiting"),
])
def test_bad_parts_are_refused_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_keys_are_held_as_digests_and_never_shown():
    assert "sk-a" not in repr(CONFIG) and "sk-a" not in repr(FlowIdentity(api_key="sk-a"))
    assert all(len(digest) == 32 for digest in CONFIG.key_tenants)
