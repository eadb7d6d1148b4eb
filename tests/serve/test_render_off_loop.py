"""A response with a prompt's scores is rendered and encoded off the event loop, as the same JSON."""

from __future__ import annotations

import asyncio
import json
import threading

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.serve.openai_render import ChoiceOutput, CompletionRenderer, json_off_loop, sse_frame
from pd.serve.stream import GenerationEvent


def _renderer_and_output(num_prompt: int = 300, k: int = 5):
    calls: list[int] = []

    def token_text(token_id: int) -> str:
        calls.append(token_id)
        return f"<{token_id}>"

    prompt = [i % 17 for i in range(num_prompt)]
    scores = [PromptLogprob(-0.5, TopLogprobs(tuple(range(k)), tuple(-0.1 * j for j in range(k))))
              for _ in range(num_prompt - 1)]
    out = ChoiceOutput()
    out.add(GenerationEvent(token_ids=[3], text="<3>", logprobs=[-1.0], finish_reason="length",
                            num_prompt_tokens=num_prompt, num_output_tokens=1, prompt_logprobs=scores,
                            top_logprobs=[TopLogprobs((3, 4), (-1.0, -2.0))]))
    return CompletionRenderer(token_text, k, prompt, "text", True), out, calls


def test_the_scores_render_in_a_worker_thread_into_the_json_the_loop_would_write():
    renderer, out, calls = _renderer_and_output()
    threads = []

    def build() -> dict:
        threads.append(threading.current_thread())
        return {"choices": [renderer.choice(0, out)]}

    loop_thread = threading.current_thread()
    encoded = asyncio.run(json_off_loop(build))
    assert threads and threads[0] is not loop_thread
    assert json.loads(encoded) == json.loads(json.dumps({"choices": [renderer.choice(0, out)]}))
    assert len(set(calls)) == len(calls) == 17  # each token's text computed once for the request
    frame = asyncio.run(sse_frame(build, off_loop=True))
    assert frame.startswith("data: ") and frame.endswith("\n\n") and json.loads(frame[6:]) == json.loads(encoded)
    assert json.loads(asyncio.run(sse_frame(build, off_loop=False))[6:]) == json.loads(encoded)
    threads.clear()
    assert asyncio.run(json_off_loop(build, off_loop=False)) == encoded and threads == [loop_thread]
