"""vLLM's ``prompt_logprobs`` as rendered: the top k by rank, and the prompt's own token with the rank it is known by."""

from __future__ import annotations

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.serve.openai_render import prompt_logprobs


def test_the_prompts_token_is_ranked_where_the_engines_top_knows_it():
    # The engine scored 3 alternatives (echo asked for 3); prompt_logprobs asked for 1.
    scores = [PromptLogprob(-0.2, TopLogprobs((7, 5, 9), (-0.2, -1.5, -2.0))),   # own token first
              PromptLogprob(-1.5, TopLogprobs((7, 5, 9), (-0.2, -1.5, -2.0))),   # second: past k, known
              PromptLogprob(-6.0, TopLogprobs((7, 5, 9), (-0.2, -1.5, -2.0)))]   # outside the engine's top
    rendered = prompt_logprobs([1, 7, 5, 4], scores, 1, lambda t: f"<{t}>")
    assert rendered[0] is None
    assert rendered[1] == {"7": {"logprob": -0.2, "rank": 1, "decoded_token": "<7>"}}
    assert rendered[2] == {"7": {"logprob": -0.2, "rank": 1, "decoded_token": "<7>"},
                           "5": {"logprob": -1.5, "rank": 2, "decoded_token": "<5>"}}
    assert rendered[3]["4"] == {"logprob": -6.0, "rank": None, "decoded_token": "<4>"} and len(rendered[3]) == 2
