"""Speculative decoding served P/D: the decode pool verifies drafts of each method (n-gram, suffix, a draft
model), and the answers are the colocated engine's without speculation, on either prefill path.

The app is ``default.yaml`` with ``engine: {speculative_config: ...}`` and the
trained SmolLM2 in fp32; the draft model is SmolLM2 itself (the only trained
checkpoint with its vocabulary), which the decode replica prefills over the
pulled prompt. Grounded prompts (repeat or edit a text given in the prompt)
make the drafts pay; the decode replicas' counters show drafts accepted;
nothing fails.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.conftest import SMOLLM2
from tests.serve.conftest import Client, ensure_app, pool_stats

THRESHOLD = 160
SOURCE = ("The meeting is on Tuesday at ten. Anna brings the slides, Ben the budget, and Carla the minutes of "
          "the last meeting. We will discuss the new office, the summer plan and the hiring of two engineers.")
PROMPTS = [f"Correct the spelling and return the text: {SOURCE.replace('e', 'ee', 3)}",
           "Repeat after me: one two three four five six seven eight nine ten"]
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "model": SMOLLM2, "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def app(ray_cluster, request):
    ensure_app("default.yaml", engine={"model": SMOLLM2, "dtype": "float32", "kv_cache_bytes": 64 * 1024**2,
                                       "speculative_config": SPECS[request.param]},
               remote_prefill_threshold=THRESHOLD)
    return Client(ray_cluster["url"])


@pytest.fixture(scope="module")
def colocated():
    from pd import LLM, SamplingParams

    llm = LLM(SMOLLM2, dtype="float32", kv_cache_bytes=64 * 1024**2)

    def run(text: str, max_tokens: int) -> str:
        [out] = llm.generate([text], SamplingParams(max_tokens=max_tokens, temperature=0))
        return out.text

    run.tokenizer = llm.tokenizer
    return run


def accepted() -> int:
    return sum(s.get("spec_num_accepted_tokens", 0) for s in pool_stats("DecodeServer"))


@pytest.mark.parametrize("path", ["local", "remote"])
def test_served_speculative_answers_equal_the_colocated_plain_engine(app, colocated, path):
    before = accepted()
    for prompt in PROMPTS:
        system = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. " + "You copy text carefully. " * 30}] \
            if path == "remote" else []
        text = colocated.tokenizer.apply_chat_template(system + [{"role": "user", "content": prompt}])
        assert (len(colocated.tokenizer.encode(text, add_special_tokens=False)) > THRESHOLD) == (path == "remote")
        status, body = app.post("/v1/completions", {"model": SMOLLM2, "prompt": text, "max_tokens": 32,
                                                    "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["text"] == colocated(text, 32), prompt
        status, text = app.request("GET", f"/debug/requests/{body['id']}")
        assert status == 200, text
        timeline = json.loads(text)
        decode = next(span for span in timeline["spans"] if span["name"] == "decode")["attributes"]
        assert decode["spec_draft_tokens"] >= decode["spec_accepted_tokens"] > 0  # the request's drafts
    assert accepted() > before  # the decode pool verified drafts and kept some
