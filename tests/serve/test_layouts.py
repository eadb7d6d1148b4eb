"""The colocated app, and the multinode layout on the two-node cluster."""

from __future__ import annotations

import pytest

from tests.serve.conftest import Client, ensure_app, pool_stats, token_counts

MODEL = "builtin:tiny-llama"
LONG = " ".join(f"word{i}" for i in range(150))


@pytest.fixture
def client(ray_cluster):
    return Client(ray_cluster["url"])


def _complete(client: Client, prompt: str) -> str:
    status, body = client.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_colocated_app_serves_the_same_text(client):
    from pd import LLM, SamplingParams

    ensure_app("colocated.yaml", decode={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}})
    llm = LLM(MODEL, num_blocks=256)
    [expected] = llm.generate([LONG], SamplingParams(max_tokens=8, temperature=0))
    assert _complete(client, LONG) == expected.text
    assert all(s["num_remote_pulls"] == 0 for s in pool_stats("DecodeServer"))


def test_a_local_prefill_never_runs_past_max_model_len(client):
    ensure_app("colocated.yaml", decode={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}})
    prompt = [5 + (i * 7) % 1000 for i in range(4095)]  # the built-in model's length is 4096
    status, body = client.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 100,
                                                    "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert token_counts(body["usage"]) == {"prompt_tokens": 4095, "completion_tokens": 1, "total_tokens": 4096}
    assert body["choices"][0]["finish_reason"] == "length"


def test_multinode_layout_puts_each_pool_on_its_node_and_moves_kv_between_them(client, ray_cluster):
    import ray

    ensure_app("multinode.yaml")
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    [prefill] = pool_stats("PrefillServer")
    [decode] = pool_stats("DecodeServer")
    assert "prefill_pool" in nodes[prefill["node_id"]] and "decode_pool" in nodes[decode["node_id"]]
    assert prefill["node_id"] != decode["node_id"]
    assert _complete(client, LONG)
    assert pool_stats("DecodeServer")[0]["num_remote_pulls"] == 1
