"""Text <-> token ids for a checkpoint directory, plus streaming detokenization.

Only the `tokenizers` library and jinja2 are used, so the router and the
engine can tokenize without importing transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# How many prompt tokens the detokenizer decodes as context before the first
# generated token, so that the first delta has the spacing it has in context.
NUM_PROMPT_CONTEXT_TOKENS = 5

# What a lossy UTF-8 decode yields for an incomplete or invalid byte sequence.
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A `tokenizers.Tokenizer` with its checkpoint's special tokens and chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = _token_id(tokenizer, bos_token)
        self.eos_token_id = _token_id(tokenizer, eos_token)
        self._template = None if chat_template is None else _compile_chat_template(chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """Load the tokenizer of a Hugging Face checkpoint directory.

        Returns None when the directory has no `tokenizer.json` (a bare
        `save_pretrained` model directory has none).
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        # Truncation or padding saved in tokenizer.json would silently change prompts.
        tokenizer.no_truncation()
        tokenizer.no_padding()

        config = _read_json(path / "special_tokens_map.json") | _read_json(path / "tokenizer_config.json")
        template_path = path / "chat_template.jinja"
        if template_path.is_file():
            chat_template = template_path.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(config.get("chat_template"))
        return cls(
            tokenizer,
            chat_template=chat_template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def max_token_chars(self) -> int:
        """The most characters any token's vocabulary entry spans (an upper bound on what one token covers)."""
        return max(len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True))

    def token_strings(self, num_ids: int) -> list[str]:
        """Each id's vocabulary entry for ids ``[0, num_ids)``, as written in tokenizer.json.

        Ids the tokenizer does not know (a model's vocabulary is often padded
        past the tokenizer's) and special tokens map to ``""``: neither spells
        text, and grammar libraries read an empty entry as "never text".
        """
        strings = [""] * num_ids
        for token, token_id in self._tokenizer.get_vocab(with_added_tokens=True).items():
            if token_id < num_ids:
                strings[token_id] = token
        for token_id, added in self._tokenizer.get_added_tokens_decoder().items():
            if added.special and token_id < num_ids:
                strings[token_id] = ""
        return strings

    def decoder_specs(self) -> list[dict[str, Any]]:
        """The decoder's steps as tokenizer.json writes them (a ``Sequence`` flattened); [] without one.

        Each is a dict with at least ``"type"`` (``"ByteLevel"``, ``"ByteFallback"``,
        ``"Metaspace"``, ``"Strip"``, ...): they say how token strings map to bytes.
        """
        spec = json.loads(self._tokenizer.to_str()).get("decoder")
        steps: list[dict[str, Any]] = []
        pending = [spec] if spec else []
        while pending:
            step = pending.pop(0)
            if step.get("type") == "Sequence":
                pending = list(step.get("decoders", [])) + pending
            else:
                steps.append(step)
        return steps

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL throughout (a single encode may hold it for seconds on a
        # long text), and the fast one skips the character offsets nobody here reads.
        [encoding] = self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render a conversation as prompt text.

        The text already holds whatever special tokens the template writes (a
        Llama-3 template starts with bos_token), so encode it with
        `add_special_tokens=False`. Raises ValueError when the checkpoint has
        no chat template or the template rejects the conversation.
        """
        if self._template is None:
            raise ValueError(
                "this checkpoint has no chat template (no `chat_template` in tokenizer_config.json "
                "and no chat_template.jinja); send a plain completion prompt instead"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template failed: {error}") from error


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas as they arrive.

    A byte-level token may end in the middle of a multi-byte UTF-8 character;
    its text is held back until a later token completes it. Two offsets into
    `token_ids` mark what has been emitted:

        token_ids:  [ ... prompt ... | generated ...................... ]
                          ^prefix_offset      ^read_offset          ^end
                          |-- emitted last --|-- not yet emitted ---|

    Each step decodes [prefix_offset, end) and emits the part past the text of
    [prefix_offset, read_offset), unless it ends in a replacement char.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self.token_ids) - NUM_PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self.token_ids)
        if self._decode(self._prefix_offset, self._read_offset).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: decoding it as context would
            # attribute the character to the prompt, so start from nothing.
            self._prefix_offset = self._read_offset
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        return "".join(self._text_parts)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (may be empty)."""
        self.token_ids.extend(new_token_ids)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """Emit held-back text as is, replacement chars included.

        Call once when generation ends; afterwards the concatenated deltas
        equal `tokenizer.decode(generated_ids)`.
        """
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        end = len(self.token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, end)
        if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._text_parts.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self.token_ids[start:end])


def _compile_chat_template(source: str) -> jinja2.Template:
    # Mirrors how transformers renders chat templates, so checkpoint templates
    # written for it produce the same text here.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _pick_chat_template(value: str | list[dict[str, str]] | None) -> str | None:
    # Older checkpoints store a list of named templates; "default" is the chat one.
    if isinstance(value, list):
        named = {entry["name"]: entry["template"] for entry in value}
        return named.get("default")
    return value


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as
    # serialized AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _token_id(tokenizer: tokenizers.Tokenizer, token: str | None) -> int | None:
    return None if token is None else tokenizer.token_to_id(token)
