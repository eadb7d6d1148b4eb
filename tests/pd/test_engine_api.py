"""Public API behaviour: bad input, aborts, sampling, checkpoints without tokenizers."""

from __future__ import annotations

import json
import shutil

import pytest

from pd import LLM, SamplingParams
from pd.engine.request import FinishReason


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint("llama")), num_blocks=64, max_model_len=256)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 256, SamplingParams(), "max_model_len"),
        ([1, 2], SamplingParams(max_tokens=257), "max_tokens"),
        ([1, 512], SamplingParams(), "vocabulary"),
        ([1, -1], SamplingParams(), "vocabulary"),
    ],
)
def test_bad_requests_name_the_field_and_engine_keeps_serving(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)
    assert llm.engine.stats().num_waiting == 0
    [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out.token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_models(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="builtin"):
        LLM("builtin:no-such-model")
    odd = tmp_path / "odd"
    shutil.copytree(checkpoint("llama"), odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(odd))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoint("llama"), corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(corrupt))


def test_checkpoint_without_tokenizer(llm):
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert out.text == "" and len(out.token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"])


def test_abort_frees_blocks_and_others_finish(llm):
    engine = llm.engine
    engine.add_request("keep", list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0))
    engine.add_request("drop", list(range(1, 60)), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.stats().num_used_blocks > 0
    assert engine.abort_request("drop")
    assert not engine.abort_request("drop")
    finished = {}
    while engine.has_unfinished_requests():
        for result in engine.step():
            assert result.request_id == "keep"
            if result.finished:
                finished[result.request_id] = result.finish_reason
    assert finished == {"keep": FinishReason.LENGTH}
    assert engine.stats().num_used_blocks == 0


def test_stop_tokens_and_logprobs(llm):
    [free] = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=8, temperature=0, logprobs=0))
    assert len(free.logprobs) == 8 and all(lp <= 0 for lp in free.logprobs)
    stop = free.token_ids[2]
    [stopped] = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=123)
    [alone] = llm.generate([[4, 5, 6]], params)
    batch = llm.generate([[1, 2], [4, 5, 6], [7] * 30], [SamplingParams(max_tokens=5), params, SamplingParams()])
    assert batch[1].token_ids == alone.token_ids
    other = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=12, temperature=1.0, seed=124))[0]
    assert other.token_ids != alone.token_ids


def test_top_k_one_is_greedy(llm):
    [greedy] = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=10, temperature=0))
    [topk] = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=10, temperature=0.8, top_k=1))
    assert topk.token_ids == greedy.token_ids


def test_a_first_token_that_reaches_max_model_len_ends_the_request(checkpoint):
    """A first token sampled elsewhere can fill the model's length: nothing more is generated."""
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine
    from pd.engine.request import FinishReason

    engine = LLMEngine(EngineConfig(model=str(checkpoint("llama")), num_blocks=64, max_model_len=64))
    engine.add_request("full", list(range(1, 64)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                       first_token_id=7)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outputs] == [([], True, FinishReason.LENGTH)]
    assert engine.stats().num_used_blocks == 0
