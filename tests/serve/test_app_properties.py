"""Property test: any mix of request fields gets 200 or an OpenAI-style 4xx, never a 5xx."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "builtin:tiny-llama"

values = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(-10, 10, allow_nan=False),
                   st.text(max_size=20), st.lists(st.integers(-2, 2000), max_size=5))
fields = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, "other"])},
    optional={
        "prompt": st.one_of(st.text(max_size=200), st.lists(st.integers(-1, 1100), max_size=40), values),
        "max_tokens": st.one_of(st.integers(-1, 8), values),
        "temperature": st.one_of(st.floats(0, 2), values),
        "top_p": st.one_of(st.floats(0, 1), values),
        "top_k": values,
        "seed": values,
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), values),
        "n": values,
        "logprobs": values,
        "stream": st.booleans(),
        "ignore_eos": values,
        "presence_penalty": values,
        "user": values,
        "echo": values,
    },
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=fields)
def test_any_completion_request_gets_an_answer_or_a_clear_4xx(default_app, body):
    body.setdefault("max_tokens", 4)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8
    status, text = default_app.request("POST", "/v1/completions", body)
    assert status == 200 or 400 <= status < 500, (status, text[:300])
    if status != 200:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"]
    elif body.get("stream") is True:
        assert text.rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
