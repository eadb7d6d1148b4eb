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


@pytest.mark.parametrize("prefill_ep, decode_ep", [(2, 1), (1, 2)])
def test_pools_of_different_expert_parallel_sizes_give_the_colocated_tokens(ray_cluster, moe_model, prefill_ep,
                                                                             decode_ep):
    """Prefill EP=2 to decode EP=1 and back: the KV belongs to attention (whole on each expert-parallel rank
    here), so every decode rank pulls every head over NIXL, and the tokens are one engine's."""
    from pd import LLM, SamplingParams

    def pool(size: int) -> dict:
        return {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}, "expert_parallel_size": size}

    ensure_app("default.yaml", model_name="qwen3-moe", engine={"model": moe_model, "kv_cache_bytes": 16 * 1024**2},
               prefill=pool(prefill_ep), decode=pool(decode_ep))
    prompt = PROMPTS[1]  # past the remote-prefill threshold
    with LLM(moe_model, num_blocks=64) as llm:
        [expected] = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    [before] = pool_stats("DecodeServer")
    assert _generate(prompt) == expected.token_ids
    [after] = pool_stats("DecodeServer")
    assert after["num_remote_pulls"] == before["num_remote_pulls"] + 1
    assert after["num_recompute_fallbacks"] == before["num_recompute_fallbacks"]
    assert len(after["tp_ranks"]) == decode_ep and len(pool_stats("PrefillServer")[0]["tp_ranks"]) == prefill_ep
    if decode_ep > 1:  # rebalanced on demand through the deployment's handle: the next tokens are the same
        from ray import serve

        decode = serve.get_deployment_handle("DecodeServer", "pd")
        decode.rebalance_experts.remote().result()
        assert _generate(prompt) == expected.token_ids
        [stats] = pool_stats("DecodeServer")
        assert stats["expert_moves"] >= 1 and 0 < stats["expert_balancedness"] <= 1
