"""API keys: the ingress refuses a missing or wrong key with 401 (no Ray needed)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from pd.serve.ingress import Ingress
from pd.serve.openai_protocol import OpenAIError


def _request(headers: dict) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw})


@pytest.fixture
def ingress():
    cls = Ingress.func_or_class  # the class behind the deployment; only its checks are used
    return cls.__new__(cls)


def test_keys_are_checked_when_configured(ingress):
    from pd.serve.args import AppArgs

    ingress.args = AppArgs(api_keys=["k1", "k2"])
    ingress._authorize(_request({"Authorization": "Bearer k2"}))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
        with pytest.raises(OpenAIError) as info:
            ingress._authorize(_request(headers))
        assert info.value.status == 401 and info.value.type == "authentication_error"


def test_no_keys_means_open(ingress):
    from pd.serve.args import AppArgs

    ingress.args = AppArgs()
    ingress._authorize(_request({}))
