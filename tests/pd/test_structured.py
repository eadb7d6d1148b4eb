"""Structured output: every token the engine samples under a grammar keeps the output inside it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.engine.request import FinishReason
from pd.engine.structured import GrammarCompiler, GrammarMask, vocab_type
from pd.sampling_params import SamplingParams, StructuredKind, StructuredOutput

PROMPTS = ["Tell me about the weather.", "A list of things:", "Hello there", "Name, age and city of a person"]
PLAIN = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
MAX_TOKENS = 256  # far beyond what a bounded schema needs, so a finish by length is a failure


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=256))


def collect(engine: LLMEngine, ends: dict | None = None) -> dict[str, list[int]]:
    """Step until every request ends: the tokens each produced; ``ends`` gets ``{id: (reason, error)}``."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and ends is not None:
                ends[out.request_id] = (out.finish_reason, out.error)
    return tokens


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, tuple[str, FinishReason, str]]:
    """Run ``requests`` together to the end: ``{id: (text, finish reason, error)}``."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, engine.tokenizer.encode(prompt), params)
    ends: dict = {}
    tokens = collect(engine, ends)
    return {request_id: (engine.tokenizer.decode(tokens[request_id]), *ends[request_id]) for request_id in requests}


def constrained(kind: StructuredKind, spec: str = "", **kwargs) -> SamplingParams:
    options = {"max_tokens": MAX_TOKENS, "temperature": 0} | kwargs
    return SamplingParams(structured=StructuredOutput(kind=kind, spec=spec), **options)


@pytest.fixture(scope="module")
def plain_alone(engine):
    """The unconstrained greedy request's text when it runs by itself."""
    return run(engine, {"plain": (PROMPTS[0], PLAIN)})["plain"]


# Schemas a random-weight model finishes well within MAX_TOKENS: every string,
# array and number is bounded, and objects forbid extra properties.
KEYS = st.text(alphabet="abcdefgxyz_", min_size=1, max_size=6)
LEAF_SCHEMAS = st.one_of(
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-1000, 1000), st.integers(0, 1000)),
    st.builds(lambda low, span: {"type": "number", "minimum": low, "maximum": low + span},
              st.integers(-100, 100), st.integers(1, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda values: {"enum": values},
              st.lists(st.one_of(st.text(alphabet="abc xyz", max_size=5), st.integers(-5, 50)),
                       min_size=1, max_size=4, unique=True)),
)


def _objects_and_arrays(children):
    objects = st.dictionaries(KEYS, children, min_size=1, max_size=3).flatmap(
        lambda properties: st.builds(
            lambda required: {"type": "object", "properties": properties, "required": required,
                              "additionalProperties": False},
            st.lists(st.sampled_from(sorted(properties)), unique=True)))
    arrays = st.builds(lambda items, low, span: {"type": "array", "items": items, "minItems": low,
                                                 "maxItems": low + span},
                       children, st.integers(0, 2), st.integers(0, 2))
    return st.one_of(objects, arrays)


SCHEMAS = st.recursive(LEAF_SCHEMAS, _objects_and_arrays, max_leaves=6).map(
    lambda schema: schema if schema.get("type") == "object" else
    {"type": "object", "properties": {"value": schema}, "required": ["value"], "additionalProperties": False})


@pytest.mark.slow  # 50 schemas through the engine, twice each: 5 s
@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, prompt=st.sampled_from(PROMPTS), seed=st.integers(0, 2**31))
def test_random_schemas_give_valid_json_greedy_and_sampled(engine, plain_alone, schema, prompt, seed):
    spec = json.dumps(schema)
    results = run(engine, {
        "greedy": (prompt, constrained(StructuredKind.JSON_SCHEMA, spec)),
        "sampled": (prompt, constrained(StructuredKind.JSON_SCHEMA, spec, temperature=1.0, seed=seed)),
        "plain": (PROMPTS[0], PLAIN),
    })
    for request_id in ("greedy", "sampled"):
        text, reason, error = results[request_id]
        assert (reason, error) == (FinishReason.STOP, None), (request_id, text)
        jsonschema.validate(json.loads(text), schema)
    assert results["plain"] == plain_alone


def test_regex_choice_and_json_object(engine, plain_alone):
    choices = ["yes", "no", 'maybe "so"\n', "ünïcödé"]
    results = run(engine, {
        "regex": (PROMPTS[1], constrained(StructuredKind.REGEX, r"[a-z]{2,5}-\d{2}( ok)?")),
        "regex-sampled": (PROMPTS[2], constrained(StructuredKind.REGEX, r"(ab|cd)+!", temperature=1.0, seed=7,
                                                  max_tokens=64)),
        **{f"choice-{seed}": (PROMPTS[seed % 4], constrained(StructuredKind.CHOICE, json.dumps(choices),
                                                             temperature=1.0, seed=seed)) for seed in range(6)},
        "object": (PROMPTS[3], constrained(StructuredKind.JSON_OBJECT, temperature=1.0, seed=3)),
        "plain": (PROMPTS[0], PLAIN),
    })
    assert re.fullmatch(r"[a-z]{2,5}-\d{2}( ok)?", results["regex"][0]) and results["regex"][1] is FinishReason.STOP
    text, reason, _ = results["regex-sampled"]
    # A random model may repeat "ab" until max_tokens: what it wrote is then a prefix of the language.
    assert re.fullmatch(r"(ab|cd)+!", text) if reason is FinishReason.STOP else re.fullmatch(r"(ab|cd)*a?c?", text)
    for seed in range(6):
        assert results[f"choice-{seed}"][:2] in [(choice, FinishReason.STOP) for choice in choices]
    text, reason, _ = results["object"]
    if reason is FinishReason.STOP:
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    assert results["plain"] == plain_alone


def test_a_complete_grammar_stops_even_with_ignore_eos(engine):
    results = run(engine, {"r": (PROMPTS[0], constrained(StructuredKind.CHOICE, '["alpha", "beta"]',
                                                        ignore_eos=True))})
    assert results["r"][0] in ("alpha", "beta") and results["r"][1] is FinishReason.STOP


@pytest.mark.parametrize("kind, spec, problem", [
    (StructuredKind.JSON_SCHEMA, '{"type": "objec"}', "invalid JSON schema: .*objec"),
    (StructuredKind.JSON_SCHEMA, "{not json", "invalid JSON schema: not JSON"),
    (StructuredKind.REGEX, "(ab", "invalid regex: .*parenthesis"),
    (StructuredKind.CHOICE, '["a", 1]', "invalid choice list: expected a non-empty JSON array of strings"),
    (StructuredKind.CHOICE, "[]", "invalid choice list"),
    (StructuredKind.JSON_OBJECT, "{}", "invalid JSON object constraint: spec must be empty"),
])
def test_invalid_constraints_raise_value_error_naming_the_problem(engine, kind, spec, problem):
    params = constrained(kind, spec)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    with pytest.raises(ValueError, match=f"structured output: {problem}"):
        engine.validate(prompt, params)
    with pytest.raises(ValueError, match=f"structured output: {problem}"):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()


def test_ingress_compiler_validates_like_the_engine(engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    good = StructuredOutput(kind=StructuredKind.REGEX, spec="[0-9]+")
    assert compiler.compile(good) is compiler.compile(good)  # cached
    with pytest.raises(ValueError, match="structured output: invalid regex"):
        compiler.compile(StructuredOutput(kind=StructuredKind.REGEX, spec="a{3,1}"))


def test_cache_is_bounded(engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids, cache_size=2)
    grammars = [StructuredOutput(kind=StructuredKind.REGEX, spec=f"x{n}") for n in range(3)]
    first = compiler.compile(grammars[0])
    second = compiler.compile(grammars[1])
    assert compiler.compile(grammars[0]) is first  # a hit, which makes grammars[1] the least recently used
    compiler.compile(grammars[2])  # evicts grammars[1]
    assert compiler.compile(grammars[0]) is first
    assert compiler.compile(grammars[1]) is not second


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}


def test_tokens_generated_elsewhere_are_replayed_before_sampling(engine):
    """A decode replica given the first token, or a stream moved mid-way, continues inside the grammar."""
    params = constrained(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
    prompt = engine.tokenizer.encode(PROMPTS[3])
    engine.add_request("whole", prompt, params)
    whole = collect(engine)["whole"]
    assert len(whole) > 4 and whole[-1] in engine.eos_token_ids
    engine.add_request("first", prompt, params, first_token_id=whole[0])
    k = len(whole) // 2
    engine.add_request("moved", prompt + whole[:k], params, num_generated=k)
    outputs = collect(engine)
    for request_id, head in (("first", whole[:1]), ("moved", whole[:k])):
        text = engine.tokenizer.decode(head + outputs[request_id])
        jsonschema.validate(json.loads(text), SCHEMA)
        assert head + outputs[request_id] == whole  # greedy: the same continuation as in one piece


def test_replayed_tokens_the_grammar_rejects_raise_value_error(engine):
    params = constrained(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
    prompt = engine.tokenizer.encode(PROMPTS[3])
    [not_json] = engine.tokenizer.encode("hello", add_special_tokens=False)[:1]
    with pytest.raises(ValueError, match=f"structured output: token {not_json} .* does not follow the grammar"):
        engine.add_request("bad-first", prompt, params, first_token_id=not_json)
    with pytest.raises(ValueError, match=f"token {not_json} \\(generated token 0\\) does not follow"):
        engine.add_request("bad-moved", prompt + [not_json], params, num_generated=1)
    [brace] = engine.tokenizer.encode("{", add_special_tokens=False)
    with pytest.raises(ValueError, match=f"token {not_json} \\(generated token 1\\) does not follow"):
        engine.add_request("bad-after-moved", prompt + [brace], params, num_generated=1, first_token_id=not_json)
    with pytest.raises(ValueError, match="num_generated"):
        engine.add_request("too-many", prompt, params, num_generated=len(prompt) + 1)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_used_blocks == 0


def test_bounded_strings_are_json_strings(engine):
    """xgrammar 0.2.9 lets a length-bounded string hold raw control characters; ours does not."""
    import xgrammar

    schema = json.dumps({"type": "string", "minLength": 1, "maxLength": 3})
    compiled = engine.grammar_compiler.compile(StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=schema))
    cases = [('"a b"', True), ('"é"', True), ('"a\x13"', False), ('"\t"', False), ('"abcd"', False), ('""', False)]
    for text, valid in cases:
        matcher = xgrammar.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == valid, text


SURROGATE = b"\xed\xa0\x80"  # U+D800 in UTF-8's shape: not UTF-8, decoded as three replacement chars
HAN = "\u4e00".encode()  # a real three-byte character


@pytest.mark.parametrize("kind, spec, before, after", [
    (StructuredKind.JSON_SCHEMA, json.dumps({"type": "string", "maxLength": 3}), b'"a', b'"'),
    (StructuredKind.JSON_SCHEMA, json.dumps({"type": "string"}), b'"a', b'"'),
    (StructuredKind.JSON_OBJECT, "", b'{"a":"', b'"}'),
    (StructuredKind.REGEX, "a.b", b"a", b"b"),
    (StructuredKind.REGEX, "a[^x]b", b"a", b"b"),
])
def test_no_constraint_admits_a_surrogate(engine, kind, spec, before, after):
    """xgrammar decodes UTF-8 leniently: its classes admitted U+D800-DFFF, which no text can hold.

    A JSON string of maxLength 3 then came back four characters long, its
    surrogate decoded as three replacement characters.
    """
    import xgrammar

    compiled = engine.grammar_compiler.compile(StructuredOutput(kind=kind, spec=spec))
    for middle, valid in ((HAN, True), (SURROGATE, False)):
        matcher = xgrammar.GrammarMatcher(compiled)
        assert (matcher.accept_string(before + middle + after) and matcher.is_completed()) == valid, (kind, middle)


def test_vocab_type_follows_the_decoder():
    import xgrammar

    llama2 = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
              {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    assert vocab_type(llama2) == (xgrammar.VocabType.BYTE_FALLBACK, True)
    assert vocab_type([{"type": "ByteFallback"}]) == (xgrammar.VocabType.BYTE_FALLBACK, False)
    assert vocab_type([{"type": "ByteLevel", "add_prefix_space": True}]) == (xgrammar.VocabType.BYTE_LEVEL, False)
    assert vocab_type([{"type": "WordPiece"}]) == (xgrammar.VocabType.RAW, False)
    assert vocab_type([]) == (xgrammar.VocabType.RAW, False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_allows_nothing_fails_its_request_alone(engine, plain_alone, temperature):
    params = constrained(StructuredKind.REGEX, "ab", temperature=temperature, seed=1)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    stuck = engine.add_request("stuck", prompt, params)
    # Walk its matcher to the end behind the engine's back: no token can follow.
    assert stuck.grammar.matcher.accept_string("ab") and stuck.grammar.matcher.accept_token(engine.eos_token_ids[0])
    engine.add_request("plain", engine.tokenizer.encode(PROMPTS[0]), PLAIN)
    ends: dict = {}
    tokens = collect(engine, ends)
    assert ends["stuck"] == (FinishReason.ERROR, "structured output: the grammar allows no next token")
    assert "stuck" not in tokens or tokens["stuck"] == []
    assert (engine.tokenizer.decode(tokens["plain"]), *ends["plain"]) == plain_alone
    assert engine.stats().num_used_blocks == 0


def test_a_token_outside_the_mask_is_rejected(engine):
    grammar = engine.grammar_compiler.start(StructuredOutput(kind=StructuredKind.REGEX, spec="[0-9]+"))
    [digit] = engine.tokenizer.encode("7", add_special_tokens=False)
    [word] = engine.tokenizer.encode("hello", add_special_tokens=False)[:1]
    mask = GrammarMask.for_rows([None, grammar], engine.model_config.vocab_size)
    mask.fill()
    assert mask.accept([5, word], {}) == ({1: f"structured output: the grammar rejected sampled token {word}"},
                                          frozenset())
    assert mask.accept([5, digit], {}) == ({}, frozenset())
    assert GrammarMask.for_rows([None, None], engine.model_config.vocab_size) is None


def test_a_prefill_replica_masks_its_one_token_and_the_decode_replica_continues(engine):
    """Disaggregated: the prefill role samples token one under the grammar; decode replays it and goes on."""
    from transfer import create_transport

    transport = create_transport("torch", "prefill-structured", role="prefill")
    try:
        prefill = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=64), transport)
        choices = ["alpha", "beta gamma", "delta"]
        for seed in range(4):
            params = constrained(StructuredKind.CHOICE, json.dumps(choices), temperature=1.0, seed=seed)
            prompt = engine.tokenizer.encode(PROMPTS[seed % 4])
            prefill.add_request(f"p{seed}", prompt, params, pin_kv=True)
            [first] = collect(prefill)[f"p{seed}"]
            prefill.release_kv(f"p{seed}")
            engine.add_request(f"d{seed}", prompt, params, first_token_id=first)
            ends: dict = {}
            rest = collect(engine, ends).get(f"d{seed}", [])
            assert engine.tokenizer.decode([first] + rest) in choices
            assert ends[f"d{seed}"] == (FinishReason.STOP, None)
    finally:
        transport.close()


def test_logprobs_are_the_raw_model_ones_not_the_masked(engine):
    """"Q" then EOS are the only tokens the grammar allows: under the mask each has probability 1."""
    params = constrained(StructuredKind.REGEX, "Q", logprobs=0)
    engine.add_request("forced", engine.tokenizer.encode(PROMPTS[0]), params)
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    assert tokens == engine.tokenizer.encode("Q", add_special_tokens=False) + [engine.eos_token_ids[0]]
    assert len(logprobs) == 2 and all(logprob < -0.01 for logprob in logprobs), logprobs
