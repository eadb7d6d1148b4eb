"""Many LoRA adapters in one batch: greedy tokens equal HF ``transformers`` under peft's own adapter, mixed
with the base model, chunked, prefix-cached, with fewer slots than adapters; and the KV knows its adapter.

The adapters are random, built and saved by peft (``tests.lora_adapters``) on
the tiny Llama: ranks 4, 8 and 16, one rsLoRA, one with ``rank_pattern`` and
``alpha_pattern``, one adapting only q and v.
"""

from __future__ import annotations

import random

import pytest

from pd import LLM, LoRARequest, SamplingParams
from pd.lora.registry import UnknownAdapter
from tests.lora_adapters import hf_peft_greedy, make_adapter
from tests.reference import assert_greedy_match

MAX_TOKENS = 12
pytestmark = pytest.mark.slow  # whole models against HF + peft, or against each other

ADAPTERS = {
    "r4": dict(r=4, alpha=8, seed=1),
    "r8_qv": dict(r=8, alpha=16, seed=2, target_modules=("q_proj", "v_proj")),
    "r16_rslora": dict(r=16, alpha=8, use_rslora=True, seed=3),
    "patterned": dict(r=8, alpha=16, rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 4}, seed=4),
}
NAMES = [None, *ADAPTERS]  # prompt i runs under NAMES[i % 5]; None: the base model
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1, 512) for _ in range(_rng.randrange(5, 41))] for _ in range(16)]
OPTIONS = {"dtype": "float32", "num_blocks": 256, "max_model_len": 256, "max_num_batched_tokens": 64,
           "enable_lora": True, "max_lora_rank": 16}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(base, root / name, **spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def requests(adapters):
    return [None if NAMES[i % 5] is None else LoRARequest(NAMES[i % 5], str(adapters[NAMES[i % 5]]))
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def references(base, adapters):
    """HF + peft's greedy tokens and top-2 gaps for each prompt under its adapter."""
    out = [None] * len(PROMPTS)
    for name in NAMES:
        indices = [i for i in range(len(PROMPTS)) if NAMES[i % 5] == name]
        found = hf_peft_greedy(base, None if name is None else adapters[name], [PROMPTS[i] for i in indices],
                               MAX_TOKENS)
        for i, reference in zip(indices, found):
            out[i] = reference
    return out


def _assert_match(outputs, references):
    for output, (tokens, gaps) in zip(outputs, references):
        assert_greedy_match(output.token_ids, tokens, gaps)


def test_adapters_and_the_base_in_one_batch_equal_hf_with_peft(base, requests, references):
    """Four adapters and the base over 16 prompts, prefills chunked to 64 tokens a step: each prompt's tokens
    are HF + peft's. Run again, the prompts' full blocks come from the prefix cache, each under its own
    adapter, and the tokens are the same."""
    with LLM(str(base), **OPTIONS, max_loras=4) as llm:
        first = llm.generate(PROMPTS, GREEDY, lora_request=requests)
        _assert_match(first, references)
        again = llm.generate(PROMPTS, GREEDY, lora_request=requests)
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        assert all(o.num_cached_tokens == len(p) // 16 * 16 - (len(p) % 16 == 0) * 16
                   for o, p in zip(again, PROMPTS))
        stats = llm.engine.stats()
        assert stats.num_loras_loaded == 4 and stats.num_lora_loads == 4
        assert llm.engine.runner.lora_slots.num_slot_loads == 4  # each adapter loaded into a slot once


def test_fewer_slots_and_host_copies_than_adapters(base, requests, references):
    """Two slots and two host copies for four adapters: requests wait for a slot (a step of more adapters than
    slots raises), host copies are evicted and read again, and every token is still HF + peft's. The
    requests of the adapters admitted first are admitted around those waiting, so each adapter is loaded
    into a slot once."""
    with LLM(str(base), **OPTIONS, max_loras=2, max_cpu_loras=2) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=requests)
        _assert_match(outputs, references)
        assert llm.engine.runner.lora_slots.num_slot_loads == 4
        stats = llm.engine.stats()
        assert stats.num_lora_loads > 4 and stats.num_loras_in_memory <= 2


def test_no_block_is_shared_across_adapters_or_with_a_reloaded_adapter(base, adapters, tmp_path):
    """The same 48-token prompt under the base, two adapters, then a reload of one with new weights under the
    same name and path: no run hits another's KV; the same adapter again does."""
    prompt = (PROMPTS[0] * 10)[:48]
    path = make_adapter(base, tmp_path / "reloaded", **ADAPTERS["r4"])
    with LLM(str(base), **OPTIONS) as llm:
        def cached(lora):
            [out] = llm.generate([prompt], GREEDY, lora_request=lora)
            return out.num_cached_tokens, out.token_ids

        assert cached(None)[0] == 0
        assert cached(LoRARequest("a", str(adapters["r16_rslora"])))[0] == 0
        hit, old_tokens = cached(LoRARequest("b", str(path)))
        assert hit == 0
        assert cached(LoRARequest("b", str(path)))[0] == 32  # the same adapter hits its own blocks
        assert cached(None)[0] == 32
        make_adapter(base, path, **{**ADAPTERS["r4"], "seed": 9})  # new weights, same name and path
        llm.add_lora(LoRARequest("b", str(path)))
        hit, new_tokens = cached(LoRARequest("b", str(path)))
        assert hit == 0 and new_tokens != old_tokens
        [(reference, _)] = hf_peft_greedy(base, path, [prompt], MAX_TOKENS)
        assert new_tokens == reference


def test_adapter_requests_refused_with_the_problem_named(base, adapters):
    with LLM(str(base), dtype="float32", num_blocks=64) as plain:
        with pytest.raises(ValueError, match="runs without adapters: set enable_lora"):
            plain.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", str(adapters["r4"])))
    with LLM(str(base), **{**OPTIONS, "max_lora_rank": 8}) as llm:
        with pytest.raises(ValueError, match="16.*max_lora_rank|max_lora_rank.*16|above"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("big", str(adapters["r16_rslora"])))
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", str(adapters["r4"])))
        with pytest.raises(ValueError, match="'a' is loaded from .*, not"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", str(adapters["r8_qv"])))
        with pytest.raises(UnknownAdapter, match="no LoRA adapter named 'nope'"):
            llm.engine.add_request("x", PROMPTS[0], GREEDY, lora="nope")
        with pytest.raises(ValueError, match="got 2 lora_requests for 1 prompts"):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=[None, None])
        assert not llm.engine.has_unfinished_requests()  # nothing refused was left behind


def test_two_tensor_parallel_ranks_equal_hf_with_peft(base, requests, references):
    """Each rank holds its shard of every adapter (B's rows of q, k, v, gate, up; A's columns of o and down),
    the worker loading it when the driver's slot does: the mixed batch's tokens are HF + peft's."""
    with LLM(str(base), **OPTIONS, max_loras=2, tensor_parallel_size=2) as llm:
        _assert_match(llm.generate(PROMPTS, GREEDY, lora_request=requests), references)
