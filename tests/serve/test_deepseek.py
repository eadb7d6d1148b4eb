"""A tiny DeepSeek-V3 checkpoint served: its prompt prefilled remotely, its latent pulled over NIXL, answered
through the official ``openai`` SDK with the colocated tokens."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.serve.conftest import Client, ensure_app, pool_stats

PROMPT = [3 + (i * 37) % 500 for i in range(300)]  # past the 256-token threshold: prefilled remotely
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory):
    return str(make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek-v3-app")))


@pytest.fixture
def client(ray_cluster, deepseek_model):
    ensure_app("default.yaml", model_name="deepseek-v3",
               engine={"model": deepseek_model, "kv_cache_bytes": 16 * 1024**2})
    return Client(ray_cluster["url"])


def test_a_deepseek_model_served_remotely_gives_the_colocated_tokens_and_pulls_its_latent(client, deepseek_model):
    from ray import serve

    from pd import LLM, SamplingParams
    from pd.engine.kv_layout import kv_block_bytes
    from pd.serve import GenerateRequest

    llm = LLM(deepseek_model, num_blocks=64)
    [expected] = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    latent_block = kv_block_bytes(llm.engine.model_config, 16, torch.float32)
    [before] = pool_stats("DecodeServer")
    request = GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    chunks = serve.get_app_handle("pd").options(stream=True).generate.remote(request)
    served = [token for chunk in chunks for token in chunk.token_ids]
    [after] = pool_stats("DecodeServer")
    assert served == expected.token_ids
    assert after["num_remote_pulls"] - before["num_remote_pulls"] == 1
    assert after["num_recompute_fallbacks"] == before["num_recompute_fallbacks"]
    pulled_blocks = after["num_pulled_blocks"] - before["num_pulled_blocks"]
    assert pulled_blocks == -(-len(PROMPT) // 16)
    assert after["num_pulled_bytes"] - before["num_pulled_bytes"] == pulled_blocks * latent_block

    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=client.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    completion = sdk.completions.create(model="deepseek-v3", prompt=PROMPT, max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"
