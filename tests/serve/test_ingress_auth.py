"""API keys: the ingress refuses a missing or wrong key with 401, and no key reaches a log or a body."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from pd.serve.auth import configured_api_keys
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
    from pd.config.app import AppArgs

    ingress._api_keys = configured_api_keys(["s3cret-key"], "")
    with pytest.raises(OpenAIError) as info:
        ingress._authorize(_request({"Authorization": "Bearer s3cret-guess"}))
    assert "s3cret" not in str(info.value.body())
    assert "s3cret" not in repr(AppArgs(api_keys=["s3cret-key"]))


def test_bad_key_config_is_refused_without_echoing_the_key():
    from pd.config.app import AppArgs

    for args in ({"api_keys": "s3cret-key"}, {"api_keys": ["s3cret-key", 5]}):
        with pytest.raises(ValueError, match="api_keys") as info:
            AppArgs.parse(args)
        assert "s3cret" not in str(info.value)


def _log_files() -> list:
    from pathlib import Path

    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file()]


def _logs_mention(text: str) -> list[str]:
    needle = text.encode()
    return [str(p) for p in _log_files() if needle in p.read_bytes()]


def test_keys_never_reach_logs_or_error_bodies(ray_cluster):
    """A real app with keys from config and environment: they authorize, and no log or body shows them."""
    import os
    import uuid

    from tests.serve.conftest import TEST_KEYS_ENV, Client, ensure_app, wait_until

    config_key, guess, marker = (f"{kind}-{uuid.uuid4().hex}" for kind in ("cfgkey", "guess", "marker"))
    env_key = os.environ[TEST_KEYS_ENV]  # the Ray nodes' environment holds it (see the ray_cluster fixture)
    ensure_app("default.yaml", api_keys=[config_key], api_keys_env=TEST_KEYS_ENV)
    client = Client(ray_cluster["url"])
    body = {"model": "builtin:tiny-llama", "prompt": "hello", "max_tokens": 2, "temperature": 0}

    def call(key: str | None, payload: dict = body):
        headers = {"X-Request-Id": marker, **({"Authorization": f"Bearer {key}"} if key else {})}
        return client.request("POST", "/v1/completions", payload, headers=headers)

    assert wait_until(lambda: call(config_key)[0] == 200, timeout=60)
    assert call(env_key)[0] == 200
    for key in (None, guess, config_key[:-1], f"{config_key},{env_key}"):
        status, text = call(key)
        assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
        assert config_key not in text and env_key not in text and guess not in text
    status, text = call(config_key, {**body, "max_tokens": -1})
    assert status == 400 and config_key not in text
    # The access log records the requests (so these are the files that would show a leak) ...
    wait_until(lambda: _logs_mention(marker), timeout=30)
    # ... and nothing written anywhere in the session's logs names a key or the guess.
    for secret in (config_key, env_key, guess):
        assert _logs_mention(secret) == [], secret


def test_adapters_load_and_unload_only_with_a_key(ingress):
    import asyncio

    from pd.serve.openai_protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

    class Control:  # what the endpoints would act on: never reached without a key
        calls: list = []

        async def load(self, name, path):
            self.calls.append(("load", name, path))
            return {}

        async def unload(self, name):
            self.calls.append(("unload", name))
            return {}

    ingress._api_keys = configured_api_keys(["k1"], "")
    ingress.adapter_control = Control()
    load = LoadLoraAdapterRequest(lora_name="a", lora_path="/adapters/a")
    unload = UnloadLoraAdapterRequest(lora_name="a")
    for call in (ingress.load_lora_adapter(load, _request({})), ingress.unload_lora_adapter(unload, _request({}))):
        with pytest.raises(OpenAIError) as info:
            asyncio.run(call)
        assert info.value.status == 401
    assert Control.calls == []
    asyncio.run(ingress.load_lora_adapter(load, _request({"Authorization": "Bearer k1"})))
    asyncio.run(ingress.unload_lora_adapter(unload, _request({"Authorization": "Bearer k1"})))
    assert Control.calls == [("load", "a", "/adapters/a"), ("unload", "a")]
