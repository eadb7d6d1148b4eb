"""LoRA adapters served P/D: a request's ``model`` names its adapter, answers equal the colocated engine's under
the same adapter on either prefill path, no KV is shared across adapters, and adapters load and unload while
the app serves.

The app is ``default.yaml`` on the tiny built-in model with one adapter from
``lora_modules``; a second is loaded through ``/v1/load_lora_adapter``. The
adapters are random, built by peft (``tests.lora_adapters``).
"""

from __future__ import annotations

import json

import pytest

from pd.model.paths import resolve_model_path
from tests.lora_adapters import make_adapter
from tests.serve.conftest import Client, ensure_app, pool_stats

BASE = "builtin:tiny-llama"
THRESHOLD = 40  # prompts longer than this prefill on the prefill pool
SHORT = list(range(3, 20))
LONG = [(7 * i) % 300 + 1 for i in range(64)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    base = resolve_model_path(BASE)
    return {"a": make_adapter(base, root / "a", r=8, seed=1), "b": make_adapter(base, root / "b", r=4, seed=2)}


@pytest.fixture(scope="module")
def app(ray_cluster, adapters):
    ensure_app("default.yaml", engine={"model": BASE, "dtype": "float32", "kv_cache_bytes": 64 * 1024**2,
                                       "enable_lora": True, "max_loras": 2,
                                       "lora_modules": {"a": str(adapters["a"])}},
               remote_prefill_threshold=THRESHOLD)
    return Client(ray_cluster["url"])


@pytest.fixture(scope="module")
def colocated(adapters):
    from pd import LLM, LoRARequest, SamplingParams

    llm = LLM(BASE, dtype="float32", kv_cache_bytes=64 * 1024**2, enable_lora=True)

    def run(prompt: list[int], adapter: str | None) -> str:
        lora = None if adapter is None else LoRARequest(adapter, str(adapters[adapter]))
        [out] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), lora_request=lora)
        return llm.tokenizer.decode(out.token_ids)

    return run


def _complete(app: Client, model: str, prompt: list[int]) -> dict:
    status, body = app.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12,
                                                "temperature": 0})
    assert status == 200, body
    return body


def _text(body: dict) -> str:
    return body["choices"][0]["text"]


def test_models_lists_the_base_and_each_adapter_with_its_parent(app, adapters):
    status, body = app.request("GET", "/v1/models")
    assert status == 200, body
    data = {entry["id"]: entry for entry in json.loads(body)["data"]}
    assert data["a"]["parent"] == BASE and data["a"]["root"] == str(adapters["a"]) and data[BASE]["parent"] is None


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["local", "remote"])
def test_an_adapters_answers_equal_the_colocated_engines_and_share_no_kv(app, colocated, prompt):
    tagged = [5, *prompt[1:]]  # a prompt of its own: no earlier test cached it
    under_a = _complete(app, "a", tagged)
    assert _text(under_a) == colocated(tagged, "a")
    base = _complete(app, BASE, tagged)
    assert _text(base) == colocated(tagged, None) != _text(under_a)
    assert base["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0  # nothing from "a"'s KV


def test_an_adapter_loads_and_unloads_while_serving(app, colocated, adapters):
    status, body = app.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/no/such/adapter"})
    assert status == 400 and "/no/such/adapter" in body["error"]["message"], body
    status, body = app.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert status == 200, body
    assert {r["pool"] for r in body["replicas"]} == {"prefill", "decode"}
    assert all(r.get("loaded") for r in body["replicas"]), body
    assert _text(_complete(app, "b", LONG)) == colocated(LONG, "b")
    assert sum(s["num_loras_loaded"] for s in pool_stats("DecodeServer")) >= 2
    status, body = app.post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200, body
    status, body = app.post("/v1/completions", {"model": "b", "prompt": SHORT, "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    status, body = app.post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404, body
