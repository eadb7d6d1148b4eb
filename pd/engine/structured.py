"""Structured output: constraints compiled to xgrammar grammars, one matcher per request.

Three pieces, from slowest-changing to fastest:

- ``GrammarCompiler`` turns a ``StructuredOutput`` into a compiled grammar for
  one tokenizer and vocabulary, cached by ``(kind, spec)``. The engine builds
  one lazily, on its first structured request; the HTTP ingress can build its
  own to reject a bad constraint before dispatch.
- ``RequestGrammar`` is one request's position in its grammar: its matcher
  has accepted every token the request produced, in order.
- ``GrammarMask`` is one step's token masks for the logits rows that have a
  grammar: filled from the matchers, applied to a copy of the logits before
  sampling, then fed the sampled tokens. Rows without a grammar are untouched.

xgrammar is imported lazily (it takes about a second to import), so an engine
that never sees a structured request never loads it.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pd.engine.spec.verify import verified_rows
from pd.model.tokenizer import Tokenizer
from pd.sampling_params import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept per compiler, least recently used evicted first. Each
# holds a token-mask cache that grows with the vocabulary (up to a few MB).
MAX_CACHED_GRAMMARS = 64
# The longest spec compiled: compilation cost is client-controlled, and the
# cache only bounds repeats of the same spec.
MAX_SPEC_CHARS = 128 * 1024
# JSON is generated without optional whitespace: a weak model given the
# choice can emit whitespace until max_tokens.
JSON_SEPARATORS = (",", ":")
# The schema of JSON_OBJECT: any object, any keys (not strict, unlike a user schema).
ANY_OBJECT_SCHEMA = '{"type": "object"}'
# How error messages name each kind's spec.
KIND_NAMES = {StructuredKind.JSON_OBJECT: "JSON object constraint", StructuredKind.JSON_SCHEMA: "JSON schema",
              StructuredKind.REGEX: "regex", StructuredKind.CHOICE: "choice list"}
# xgrammar 0.2.9 lowers a string with minLength/maxLength to this bare class, which admits raw
# control characters (invalid JSON) and no escapes (mlc-ai/xgrammar#800). Each bounded character
# becomes an unescaped JSON character instead: escapes stay out of reach there, as before, but
# the output is valid JSON. (A rule that also allows an escape made filling a mask inside such a
# string about 150 times slower: xgrammar cannot precompute its token masks.)
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"
# xgrammar prefixes its messages with "[time] path/file.cc:line: " and sometimes a failed check.
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _xgr():
    """The xgrammar module, imported on first use."""
    import xgrammar

    return xgrammar


def vocab_type(decoder_specs: Sequence[dict[str, Any]]) -> tuple[xgrammar.VocabType, bool]:
    """``(vocab type, add_prefix_space)`` from a tokenizer's decoder steps (``Tokenizer.decoder_specs``).

    ByteLevel decoders spell bytes with printable stand-ins (GPT-2's "Ġ");
    ByteFallback ones write "<0x0A>" pieces and "▁" for a space, and a
    leading ``Strip`` or a prepending ``Metaspace`` means the encoder added a
    space the first token's text does not carry. Anything else is raw text.
    """
    xgr = _xgr()
    types = {step.get("type") for step in decoder_specs}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" not in types:
        return xgr.VocabType.RAW, False
    prefix_space = any(
        (step.get("type") == "Strip" and step.get("start", 0) > 0)
        or (step.get("type") == "Metaspace"
            and (step.get("add_prefix_space") or step.get("prepend_scheme") in ("always", "first")))
        for step in decoder_specs
    )
    return xgr.VocabType.BYTE_FALLBACK, prefix_space


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of ``tokenizer`` padded to the model's ``vocab_size``, built without transformers.

    Special tokens and padding ids are empty entries, so no grammar ever
    allows them as text; ``eos_token_ids`` are the stop tokens a complete
    grammar allows (and only they).
    """
    kind, prefix_space = vocab_type(tokenizer.decoder_specs())
    return _xgr().TokenizerInfo(
        tokenizer.token_strings(vocab_size), kind, vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids), add_prefix_space=prefix_space,
    )


def choice_grammar(spec: str) -> str:
    """The EBNF grammar whose sentences are exactly the strings of the JSON array ``spec``."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured output: invalid choice list: not JSON: {exc}") from exc
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("structured output: invalid choice list: expected a non-empty JSON array of strings")
    return "root ::= " + " | ".join(_ebnf_literal(choice) for choice in choices)


def json_schema_grammar(schema: str, strict: bool = True) -> str:
    """xgrammar's EBNF grammar of compact JSON text valid under ``schema``."""
    return str(_xgr().Grammar.from_json_schema(
        schema, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=strict))


def fix_bounded_strings(grammar: str) -> str:
    """``grammar`` with each length-bounded string character a JSON character (see ``_BOUNDED_STRING_CHAR``)."""
    return grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


# xgrammar decodes UTF-8 leniently: a negated class, or the full range a regex's "." becomes, matches
# the three bytes of a UTF-16 surrogate (U+D800-DFFF), which no UTF-8 text holds. A string sampled
# through one decodes to three replacement characters: a JSON string of maxLength 3 came back longer.
_SURROGATES = r"\uD800-\uDFFF"
_EVERY_CHAR = r"\0-\U0010ffff"


def exclude_surrogates(grammar: str) -> str:
    """``grammar`` (xgrammar EBNF) with no character class that admits a surrogate (see ``_SURROGATES``)."""
    out, index, end = [], 0, len(grammar)
    while index < end:
        char = grammar[index]
        if char not in '"[':
            out.append(char)
            index += 1
            continue
        close = '"' if char == '"' else "]"
        stop = index + 1
        while stop < end and grammar[stop] != close:
            stop += 2 if grammar[stop] == "\\" else 1
        body = grammar[index + 1 : stop]
        if char == "[":
            if body.startswith("^"):
                body += _SURROGATES
            elif body == _EVERY_CHAR:
                body = "^" + _SURROGATES
        out.append(char + body + close)  # a string literal is copied as it is
        index = stop + 1
    return "".join(out)


def _ebnf_literal(text: str) -> str:
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\x{ord(char):02x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _library_message(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _LIBRARY_PREFIX.sub("", lines[0] if lines else type(exc).__name__).strip()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; safe to call from several threads.

    ``compile`` raises ``ValueError("structured output: invalid <what>: <why>")``
    for a constraint that cannot be compiled. A JSON schema compiles in
    xgrammar's strict mode (as vLLM does): an object has only the properties
    its schema lists unless ``additionalProperties`` says otherwise. JSON is
    compact (no optional whitespace). Compilation cost is client-controlled:
    it is bounded by ``MAX_SPEC_CHARS`` per spec and, for repeats, by an LRU
    cache of ``cache_size`` compiled grammars (a schema compiles in a few ms on
    a small vocabulary; pathological regexes can take longer).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = MAX_CACHED_GRAMMARS):
        if not eos_token_ids:
            raise ValueError("structured output needs the model's EOS token ids, and this model has none")
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        # Our own bounded cache replaces xgrammar's, which is unbounded by default.
        self._compiler = _xgr().GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict[tuple[StructuredKind, str], xgrammar.CompiledGrammar] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``constraint``; ``ValueError`` naming the problem if it has none."""
        key = (constraint.kind, constraint.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile_uncached(constraint)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def start(self, constraint: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for one request, at the start of ``constraint``'s grammar."""
        return RequestGrammar(_xgr().GrammarMatcher(self.compile(constraint)))

    def _compile_uncached(self, constraint: StructuredOutput) -> xgrammar.CompiledGrammar:
        kind, spec = constraint.kind, constraint.spec
        what = KIND_NAMES[kind]
        if len(spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output: invalid {what}: {len(spec)} characters, over {MAX_SPEC_CHARS}")
        if kind is StructuredKind.JSON_OBJECT and spec:
            raise ValueError(f"structured output: invalid {what}: spec must be empty, got {spec[:40]!r}")
        if kind is StructuredKind.JSON_SCHEMA:
            try:
                json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured output: invalid {what}: not JSON: {exc}") from exc
        if kind is StructuredKind.CHOICE:
            return self._compile_ebnf(choice_grammar(spec), what)
        try:
            if kind is StructuredKind.REGEX:
                grammar = str(_xgr().Grammar.from_regex(spec))
            else:
                grammar = fix_bounded_strings(json_schema_grammar(
                    ANY_OBJECT_SCHEMA if kind is StructuredKind.JSON_OBJECT else spec,
                    strict=kind is StructuredKind.JSON_SCHEMA))
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports every parse error as one of these
            raise ValueError(f"structured output: invalid {what}: {_library_message(exc)}") from exc
        return self._compile_ebnf(exclude_surrogates(grammar), what)

    def _compile_ebnf(self, grammar: str, what: str) -> xgrammar.CompiledGrammar:
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured output: invalid {what}: {_library_message(exc)}") from exc


class RequestGrammar:
    """One request's matcher: where its output so far leaves it in its grammar.

    Invariant: it has accepted exactly the request's output tokens (and, for a
    migrated stream, the replayed ones), in order. Preemption recomputes KV
    but samples nothing new, so it never needs to roll back.
    """

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self.matcher = matcher
        # Only a stop token can terminate the grammar: the one case to ask the matcher about.
        self.stop_token_ids = frozenset(matcher.stop_token_ids)

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the grammar allows nothing more."""
        return self.matcher.is_terminated()

    def replay(self, token_ids: Sequence[int], first_index: int = 0) -> None:
        """Accept tokens generated earlier under this grammar; ``ValueError`` at the first it rejects.

        ``first_index`` is the position of ``token_ids[0]`` in the output, for the message.
        """
        for index, token_id in enumerate(token_ids, start=first_index):
            if self.is_terminated or not self.matcher.accept_token(token_id):
                raise ValueError(
                    f"structured output: token {token_id} (generated token {index}) does not follow the grammar")


class GrammarMask:
    """One step's masks for the logits rows whose request has a grammar.

    ``fill`` writes the bitmask (it reads only matcher state); ``apply`` then
    masks a copy of the logits, leaving the raw ones for log-probabilities;
    ``accept`` advances each matcher past its row's sampled token. Rows
    without a grammar keep an all-ones mask row, so applying the whole
    bitmask leaves them as they are.

    A row whose mask allows nothing is all ``-inf``: its draw fails or picks a
    token the grammar rejects, so it fails alone, and only then is its mask
    read again to say why (checking every row every step costs more than the
    rest of the masking).
    """

    def __init__(self, grammars: Sequence[RequestGrammar | None], vocab_size: int,
                 groups: dict[int, Sequence[int]] | None = None):
        self.rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        self.grammars = [grammars[row] for row in self.rows]
        self.vocab_size = vocab_size
        # Verify groups (``pd.engine.spec.verify``): first row -> drafts; rows first + j follow drafts[:j].
        self.groups = {row: drafts for row, drafts in (groups or {}).items() if grammars[row] is not None}
        self._in_group = {first + j for first, drafts in self.groups.items() for j in range(1, len(drafts) + 1)}
        # [num_rows, ceil(vocab_size / 32)] int32, all ones: bit t of a row set = token t allowed.
        self.bitmask = _xgr().allocate_token_bitmask(len(grammars), vocab_size)

    @classmethod
    def for_rows(cls, grammars: Sequence[RequestGrammar | None], vocab_size: int,
                 groups: dict[int, Sequence[int]] | None = None) -> GrammarMask | None:
        """None when no row has a grammar: such steps pay nothing."""
        if all(grammar is None for grammar in grammars):
            return None
        return cls(grammars, vocab_size, groups)

    def fill(self) -> None:
        for row, grammar in zip(self.rows, self.grammars):
            if row in self._in_group:
                continue
            if row in self.groups:
                self._fill_group(row, grammar, self.groups[row])
                continue
            self._fill_row(row, grammar)

    def _fill_row(self, row: int, grammar: RequestGrammar) -> None:
        try:
            grammar.matcher.fill_next_token_bitmask(self.bitmask, row)
        except RuntimeError:  # a terminated (or broken) matcher: its row allows nothing, and fails alone
            self.bitmask[row] = 0

    def _fill_group(self, first: int, grammar: RequestGrammar, drafts: Sequence[int]) -> None:
        """Row ``first + j`` as the grammar stands after ``drafts[:j]``; the matcher is rolled back after.

        Rows after a draft the grammar rejects keep all ones: no draw reaches them, since the row before
        cannot draw that draft (``pd.engine.spec.verify``).
        """
        accepted = 0
        for j in range(len(drafts) + 1):
            self._fill_row(first + j, grammar)
            if j == len(drafts) or grammar.is_terminated or not grammar.matcher.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            grammar.matcher.rollback(accepted)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A masked copy of ``logits [num_rows, vocab]``, after ``fill``."""
        masked = logits.clone()
        # Pinned on CUDA, so that the copy is queued, not waited for (pageable memory is copied synchronously).
        bitmask = self.bitmask.pin_memory() if logits.is_cuda else self.bitmask
        # Without ``indices`` xgrammar's CPU kernel is twice as fast, and all-ones rows change nothing.
        _xgr().apply_token_bitmask_inplace(masked, bitmask.to(logits.device, non_blocking=True))
        return masked

    def accept(self, sampled_token_ids: Sequence[int | None], errors: dict[int, str]) -> tuple[
            dict[int, str], frozenset[int]]:
        """Advance each grammar row past its sampled token.

        ``errors`` are the rows sampling already failed. Returns
        ``({row: error}, rows whose grammar terminated)``: rejected tokens,
        and failed rows whose mask allowed nothing, with that as the reason.
        """
        new_errors: dict[int, str] = {}
        terminated: set[int] = set()
        for row, grammar in zip(self.rows, self.grammars):
            if row in self._in_group:
                continue
            for row in self._group_rows(row, sampled_token_ids):
                token_id = sampled_token_ids[row]
                if row not in errors and grammar.matcher.accept_token(token_id):
                    if token_id in grammar.stop_token_ids and grammar.is_terminated:
                        terminated.add(row)
                        break
                    continue
                if self._allows_nothing(row):
                    new_errors[row] = "structured output: the grammar allows no next token"
                elif row not in errors:
                    new_errors[row] = f"structured output: the grammar rejected sampled token {token_id}"
                break
        return new_errors, frozenset(terminated)

    def _group_rows(self, row: int, sampled_token_ids: Sequence[int | None]) -> list[int]:
        """The rows whose tokens ``row``'s request outputs: itself, or its verify group's verified rows."""
        drafts = self.groups.get(row)
        if drafts is None:
            return [row]
        return verified_rows(sampled_token_ids, drafts, row) or [row]

    def _allows_nothing(self, row: int) -> bool:
        words = self.bitmask[row].numpy().view(np.uint32).copy()
        if self.vocab_size % 32:
            words[-1] &= (1 << (self.vocab_size % 32)) - 1  # bits past the vocabulary are no tokens
        return not words.any()
