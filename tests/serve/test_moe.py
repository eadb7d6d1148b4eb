"""A Qwen3-MoE checkpoint served: on the P/D path (its KV pulled over NIXL) and locally, the colocated tokens."""

from __future__ import annotations

import pytest

from tests.checkpoints import make_checkpoint
from tests.serve.conftest import Client, ensure_app, pool_stats

PROMPTS = [list(range(20, 60)), [3 + (i * 37) % 500 for i in range(300)]]  # the second past the 256-token threshold
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3-moe-app")))


@pytest.fixture
def client(ray_cluster, moe_model):
    ensure_app("default.yaml", model_name="qwen3-moe", engine={"model": moe_model, "kv_cache_bytes": 16 * 1024**2})
    return Client(ray_cluster["url"])


def test_a_moe_model_served_on_either_prefill_path_gives_the_colocated_tokens(client, moe_model):
    from pd import LLM, SamplingParams

    llm = LLM(moe_model, num_blocks=64)
    expected = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                          ignore_eos=True))]
    for prompt, tokens in zip(PROMPTS, expected):
        [before] = pool_stats("DecodeServer")
        served = _generate(prompt)
        [after] = pool_stats("DecodeServer")
        remote = len(prompt) > 256
        assert after["num_remote_pulls"] - before["num_remote_pulls"] == int(remote)
        assert after["num_recompute_fallbacks"] == before["num_recompute_fallbacks"]
        assert served == tokens, (remote, served, tokens)
    status, body = client.post("/v1/completions", {"model": "qwen3-moe", "prompt": PROMPTS[1], "max_tokens": 4,
                                                    "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body  # and over HTTP


def _generate(prompt: list[int]) -> list[int]:
    """Through the handle API, which gives token ids (this checkpoint has no tokenizer)."""
    from ray import serve

    from pd.serve import GenerateRequest

    request = GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    chunks = serve.get_app_handle("pd").options(stream=True).generate.remote(request)
    return [token for chunk in chunks for token in chunk.token_ids]
