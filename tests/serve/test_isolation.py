"""One request's failure is its own: three streams run while others fail or ask for the absurd.

The app serves a checkpoint whose embedding of one token is NaN: a prompt
holding it gets NaN logits, on the prefill pool (a long prompt) or on the
decode replica (a short one). Nothing else shares those rows.
"""

from __future__ import annotations

import json
import threading

import pytest

from tests.checkpoints import make_poisoned_checkpoint
from tests.serve.conftest import Client, ensure_app, pool_stats, wait_until

POISON = 77
STREAM_PROMPTS = [list(range(10, 40)), list(range(100, 400)), list(range(50, 70))]  # the second prefills remotely
STREAM_TOKENS = 48


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    return str(make_poisoned_checkpoint(tmp_path_factory.mktemp("poisoned-app"), POISON))


@pytest.fixture
def client(ray_cluster, poisoned):
    ensure_app("default.yaml", model_name="poisoned",
               engine={"model": poisoned, "kv_cache_bytes": 64 * 1024**2, "max_num_batched_tokens": 256})
    return Client(ray_cluster["url"])


def _body(prompt: list[int], **fields) -> dict:
    return {"model": "poisoned", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}


def _stream_tokens(prompt: list[int], results: dict, key: int) -> None:
    """A stream through the handle API, which gives token ids (this checkpoint has no tokenizer)."""
    from ray import serve

    from pd.serve import GenerateRequest

    request = GenerateRequest(prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True)
    chunks = serve.get_app_handle("pd").options(stream=True).generate.remote(request)
    results[key] = [t for chunk in chunks for t in chunk.token_ids]


def test_bad_requests_fail_alone_while_three_streams_run(client, poisoned):
    from pd import LLM, SamplingParams

    llm = LLM(poisoned, num_blocks=256)
    expected = [o.token_ids for o in llm.generate(STREAM_PROMPTS, SamplingParams(max_tokens=STREAM_TOKENS, temperature=0,
                                                                                  ignore_eos=True))]
    streamed: dict = {}
    threads = [threading.Thread(target=_stream_tokens, args=(p, streamed, i)) for i, p in enumerate(STREAM_PROMPTS)]
    for thread in threads:
        thread.start()
    # A temperature too small to divide by: greedy, not a crash of the replica.
    status, body = client.post("/v1/completions", _body(STREAM_PROMPTS[0], temperature=1e-300, max_tokens=STREAM_TOKENS))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == STREAM_TOKENS
    # NaN logits, computed on the decode replica and on the prefill pool: that request alone fails, clearly.
    for prompt in ([5, 6, POISON, 8], [POISON] + list(range(150, 450))):
        status, body = client.post("/v1/completions", _body(prompt))
        assert status == 500 and "non-finite logits" in body["error"]["message"], body
        events = client.request("POST", "/v1/completions", _body(prompt, stream=True))[1]
        last = json.loads([line for line in events.splitlines() if line.startswith("data: ")][-1][6:])
        assert "non-finite logits" in last["error"]["message"], events
    for thread in threads:
        thread.join(120)
    assert streamed == dict(enumerate(expected))
    wait_until(lambda: all(s["num_used_blocks"] == 0 for s in pool_stats("DecodeServer") + pool_stats("PrefillServer")))
