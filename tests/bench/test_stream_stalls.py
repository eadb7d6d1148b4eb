"""``bench.stream_stalls``: its prompts are the lengths its cases name, and a gap is measured where it ends."""

from __future__ import annotations

import pytest

from bench import stream_stalls
from bench.stream_stalls import Streams, case_bodies


@pytest.fixture(scope="module")
def tokenizer():
    from pd.model.paths import resolve_model_path
    from pd.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_path(stream_stalls.MODEL))


def test_the_long_prompts_are_as_long_as_the_cases_say_and_the_local_ones_prefill_locally(tokenizer):
    [echo] = case_bodies("echo_max", None)
    assert len(tokenizer.encode(echo["prompt"])) == stream_stalls.MAX_MODEL_LEN - 1
    assert echo["max_tokens"] == 0 and echo["echo"] and echo["logprobs"] == 20
    assert len(tokenizer.encode(case_bodies("best_of", None)[0]["prompt"])) == 1550
    [scored] = case_bodies("prompt_logprobs", None)
    assert scored["prompt"] == echo["prompt"] and scored["prompt_logprobs"] == 20 and scored["max_tokens"] == 1
    assert case_bodies("echo_max_burst", None) == [echo] * 8
    local = case_bodies("local_burst", None)
    assert len({body["prompt"] for body in local}) == 8  # each its own: nothing cached between them
    assert all(200 <= len(tokenizer.encode(body["prompt"])) < 256 for body in local)  # remote_prefill_threshold
    with pytest.raises(ValueError, match="unknown case"):
        case_bodies("nope", None)


def test_the_worst_gap_is_the_longest_that_ended_in_the_window_or_is_still_open_at_its_end():
    streams = Streams("http://127.0.0.1:1", 2)
    streams.arrivals, streams.open = [[0.0, 0.1, 0.2, 1.5, 1.6], [0.0, 0.9, 1.0]], [False, False]
    assert streams.worst_gap(1.0, 2.0) == pytest.approx(1.3)  # 0.2 -> 1.5 ended inside
    assert streams.worst_gap(0.0, 0.95) == pytest.approx(0.9)
    assert streams.worst_gap(5.0, 6.0) == 0.0
    assert streams.median_gap(1.0, 2.0) == pytest.approx(0.1) and streams.median_gap(5.0, 6.0) == 0.0
    assert streams.stalls(1.0, 2.0) == [[0.5, 1.3]] and streams.stalls(0.0, 2.0, over_s=0.85) == [[0.9, 0.9], [1.5, 1.3]]
    streams.arrivals.append([1.2, 1.3])  # a completion starved since 1.3, still streaming
    streams.open.append(True)
    assert streams.worst_gap(1.0, 2.0) == pytest.approx(1.3) and streams.worst_gap(1.0, 3.0) == pytest.approx(1.7)
    streams.open[-1] = False  # it finished at 1.3: no gap after
    assert streams.worst_gap(1.0, 3.0) == pytest.approx(1.3)
