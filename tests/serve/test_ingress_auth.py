"""API keys: the ingress refuses a missing or wrong key with 401 (no Ray needed)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from pd.serve.ingress import Ingress, configured_api_keys
from pd.serve.openai_protocol import OpenAIError


def _request(headers: dict) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw})


@pytest.fixture
def ingress():
    cls = Ingress.func_or_class  # the class behind the deployment; only its checks are used
    return cls.__new__(cls)


def test_keys_are_checked_when_configured(ingress):
    ingress._api_keys = configured_api_keys(["k1"], " k2 ,")
    ingress._authorize(_request({"Authorization": "Bearer k2"}))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
        with pytest.raises(OpenAIError) as info:
            ingress._authorize(_request(headers))
        assert info.value.status == 401 and info.value.type == "authentication_error"


def test_no_keys_means_open(ingress):
    ingress._api_keys = configured_api_keys([], "")
    ingress._authorize(_request({}))


def test_keys_are_compared_in_constant_time(ingress, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    ingress._api_keys = configured_api_keys(["first-key", "second-key"], "")
    ingress._authorize(_request({"Authorization": "Bearer first-key"}))
    # Every key is compared, even after a match, and only through compare_digest.
    assert [b for _, b in calls] == [b"first-key", b"second-key"]


def test_keys_stay_out_of_errors_and_reprs(ingress):
    from pd.serve.args import AppArgs

    ingress._api_keys = configured_api_keys(["s3cret-key"], "")
    with pytest.raises(OpenAIError) as info:
        ingress._authorize(_request({"Authorization": "Bearer s3cret-guess"}))
    assert "s3cret" not in str(info.value.body())
    assert "s3cret" not in repr(AppArgs(api_keys=["s3cret-key"]))
