"""Workloads: deterministic request streams for load tests.

A workload maps a request index to a ``LoadRequest``. Request ``i`` is the
same for a given seed and settings no matter which user sends it or when, so
two runs (or two servers) see the same prompts:

    workload.request(0), workload.request(1), ...   users take indices from one counter

Kinds:

- ``chat``: conversations that share a few system prompts and grow turn by
  turn (prefix-heavy). Conversations are interleaved in groups, so turn
  ``t + 1`` of a conversation comes ``group_size`` requests after turn ``t``:

      group 0: c0.t0 c1.t0 .. c15.t0  c0.t1 c1.t1 .. c15.t1  ..  c15.t3 | group 1: c16.t0 ..

  Assistant turns in the history are synthesized too; they are not the
  server's replies, which keeps every prompt independent of timing.
- ``long-short``: long prompt, short output (prefill-heavy, like summarization).
- ``short-long``: short prompt, long output (decode-heavy).
- ``mixed``: each request is one of the three above, drawn by weight.
- ``trace``: replay of a Mooncake-format JSONL trace (``timestamp`` in ms,
  ``input_length``, ``output_length``, ``hash_ids``), read by ``pd.workload.trace``.
  Each hash id stands for one block of ``block_size`` tokens; equal hash ids
  give equal token ids, so the trace's prefix sharing is reproduced. Prompts
  are token ids, sent to ``/v1/completions``.

Lengths are in tokens. Text prompts are built from common English words that
are one token each (with their leading space) for ``builtin:tiny-llama`` and
for Llama-3/Qwen-style tokenizers, so a prompt of ``n`` words is about ``n``
tokens; the exact counts the server saw are recorded per request.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from dataclasses import dataclass
from typing import Iterator, Protocol

from pd.workload.trace import TRACE_BLOCK_TOKENS, TraceRequest, read_trace

# The OpenAI routes a request goes to: chat ``messages`` or a completion ``prompt``. The load-test
# client sends to them and records which; the simulator's replay reads the record back.
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# Each is one token, with its leading space, in builtin:tiny-llama's vocabulary.
WORDS = (
    "about add afternoon air an and answer apples are arrive asked assistant at attention autumn away back bag "
    "baker baskets be before better between beyond blue boats box bread brown built but butter by cache called "
    "came can capital carried children cold compute cook cut day days decides decode different does dog door "
    "down each earlier eight either evening every everything fall few fields fine first fish five for forward "
    "four fox fresh from full gave gives good has he here his in into is it its jumps largest lets light limited "
    "machine many memory model more morning of on one or over planet poem pot prefill prompt question quick ran "
    "request requests river salt school seven short small so stick system table that the them then there they "
    "through time to token tokens town two until upon user valley was water week were which with you"
).split()


@dataclass(frozen=True)
class LoadRequest:
    """One request: chat ``messages`` or a completion ``prompt`` (text or token ids)."""

    index: int
    kind: str
    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    prompt: str | tuple[int, ...] = ""
    arrival_s: float | None = None  # offset from the start of a trace replay

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        """The request as ``/v1/chat/completions`` messages; a text prompt becomes one user turn."""
        if self.messages:
            return [{"role": role, "content": content} for role, content in self.messages]
        if not isinstance(self.prompt, str):
            raise ValueError(f"{self.kind} requests are token ids; send them to /v1/completions")
        return [{"role": "user", "content": self.prompt}]

    def completion_prompt(self) -> str | list[int]:
        """The request as a ``/v1/completions`` prompt; chat turns become ``role: content`` lines."""
        if self.messages:
            return "\n".join(f"{role}: {content}" for role, content in self.messages)
        return self.prompt if isinstance(self.prompt, str) else list(self.prompt)


class Workload(Protocol):
    name: str

    def request(self, index: int) -> LoadRequest: ...

    @property
    def num_requests(self) -> int | None:
        """How many requests there are; None for an endless stream."""


def _rng(seed: int, *key: object) -> random.Random:
    # String seeds hash with SHA-512: the same stream on every machine and run.
    return random.Random(":".join(str(part) for part in (seed, *key)))


def _jittered(rng: random.Random, length: int, spread: float) -> int:
    low, high = round(length * (1 - spread)), round(length * (1 + spread))
    return max(1, rng.randint(low, max(low, high)))


def _text(rng: random.Random, num_tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_tokens))


@dataclass(frozen=True)
class ChatWorkload:
    """Multi-turn chats over a few shared system prompts (prefix-heavy)."""

    seed: int = 0
    num_system_prompts: int = 4
    system_prompt_len: int = 512
    num_turns: int = 4
    user_turn_len: int = 32
    assistant_turn_len: int = 64
    output_len: int = 64
    group_size: int = 16
    len_spread: float = 0.2
    output_spread: float = 0.2
    name: str = "chat"

    @property
    def num_requests(self) -> None:
        return None

    def request(self, index: int) -> LoadRequest:
        per_group = self.group_size * self.num_turns
        group, within = divmod(index, per_group)
        turn, member = divmod(within, self.group_size)
        conversation = group * self.group_size + member
        system = conversation % self.num_system_prompts
        messages = [("system", _text(_rng(self.seed, "system", system), self.system_prompt_len))]
        for past in range(turn):
            messages.append(("user", self._turn(conversation, past, "user", self.user_turn_len)))
            messages.append(("assistant", self._turn(conversation, past, "assistant", self.assistant_turn_len)))
        messages.append(("user", self._turn(conversation, turn, "user", self.user_turn_len)))
        max_tokens = _jittered(_rng(self.seed, self.name, index), self.output_len, self.output_spread)
        return LoadRequest(index, self.name, max_tokens, messages=tuple(messages))

    def _turn(self, conversation: int, turn: int, role: str, length: int) -> str:
        rng = _rng(self.seed, "conversation", conversation, turn, role)
        return _text(rng, _jittered(rng, length, self.len_spread))


@dataclass(frozen=True)
class PromptWorkload:
    """Independent text prompts of one length class, for ``/v1/completions``."""

    name: str
    prompt_len: int
    output_len: int
    seed: int = 0
    len_spread: float = 0.2
    output_spread: float = 0.2

    @property
    def num_requests(self) -> None:
        return None

    def request(self, index: int) -> LoadRequest:
        rng = _rng(self.seed, self.name, index)
        prompt = _text(rng, _jittered(rng, self.prompt_len, self.len_spread))
        return LoadRequest(index, self.name, _jittered(rng, self.output_len, self.output_spread), prompt=prompt)


def long_short(seed: int = 0) -> PromptWorkload:
    return PromptWorkload("long-short", prompt_len=1024, output_len=16, seed=seed)


def short_long(seed: int = 0) -> PromptWorkload:
    return PromptWorkload("short-long", prompt_len=32, output_len=256, seed=seed)


@dataclass(frozen=True)
class MixedWorkload:
    """Each request drawn by weight from chat, long-short and short-long."""

    chat: ChatWorkload = ChatWorkload()
    long_short: PromptWorkload = long_short()
    short_long: PromptWorkload = short_long()
    chat_weight: float = 1.0
    long_short_weight: float = 1.0
    short_long_weight: float = 1.0
    seed: int = 0
    name: str = "mixed"

    @property
    def num_requests(self) -> None:
        return None

    def request(self, index: int) -> LoadRequest:
        parts = (self.chat, self.long_short, self.short_long)
        weights = (self.chat_weight, self.long_short_weight, self.short_long_weight)
        part = _rng(self.seed, self.name, index).choices(parts, weights)[0]
        return part.request(index)


@dataclass(frozen=True)
class TraceWorkload:
    """Replay of a Mooncake-format trace with synthesized token-id prompts.

    Hash id ``h`` is the block of ``block_size`` token ids drawn from
    ``[token_id_low, token_id_high)`` by a generator seeded with ``(seed, h)``;
    a prompt is its blocks in order, cut to ``input_length``. Tokens past the
    last block, if a record has any, are unique to the request.
    ``max_input_len``/``max_output_len`` cap lengths for small models (the cut
    keeps the prefix, so shared prefixes stay shared); ``time_scale`` stretches
    the arrival times (0.5 replays twice as fast).
    """

    path: str
    seed: int = 0
    block_size: int = TRACE_BLOCK_TOKENS
    token_id_low: int = 0
    token_id_high: int = 1000
    max_input_len: int | None = None
    max_output_len: int | None = None
    time_scale: float = 1.0
    name: str = "trace"

    @functools.cached_property
    def records(self) -> list[TraceRequest]:
        """The trace's requests in file order; a bad line fails with its line number and field."""
        return read_trace(self.path)

    @property
    def num_requests(self) -> int:
        return len(self.records)

    def request(self, index: int) -> LoadRequest:
        record = self.records[index]
        input_len = min(record.input_length, self.max_input_len or record.input_length)
        token_ids: list[int] = []
        for hash_id in record.hash_ids:
            if len(token_ids) >= input_len:
                break
            token_ids.extend(self._block(hash_id))
        if len(token_ids) < input_len:
            rng = _rng(self.seed, "trace-tail", index)
            token_ids.extend(rng.randrange(self.token_id_low, self.token_id_high)
                             for _ in range(input_len - len(token_ids)))
        output_len = min(record.output_length, self.max_output_len or record.output_length)
        return LoadRequest(index, self.name, max(1, output_len), prompt=tuple(token_ids[:input_len]),
                           arrival_s=self.arrival_s(index))

    def arrival_s(self, index: int) -> float:
        """Seconds from the first record to record ``index``, times ``time_scale``."""
        return (self.records[index].timestamp_ms - self.records[0].timestamp_ms) / 1000 * self.time_scale

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - the workload lives for the whole run
    def _block(self, hash_id: int) -> tuple[int, ...]:
        rng = _rng(self.seed, "block", hash_id)
        return tuple(rng.randrange(self.token_id_low, self.token_id_high) for _ in range(self.block_size))


def arrivals(rate: float, process: str = "poisson", seed: int = 0) -> Iterator[tuple[float, int]]:
    """Open-loop arrivals at ``rate`` requests/s: endless ``(seconds from the start, request index)``.

    ``poisson``: exponential gaps from a seeded generator, so every run (and
    every server compared) gets the same arrival times; ``constant``: even gaps.
    """
    if rate <= 0:
        raise ValueError(f"arrival rate must be positive, not {rate}")
    rng = _rng(seed, "arrivals")
    at = 0.0
    for index in itertools.count():
        yield at, index
        at += rng.expovariate(rate) if process == "poisson" else 1.0 / rate


def trace_arrivals(trace: TraceWorkload, rate: float | None = None) -> Iterator[tuple[float, int]]:
    """A trace's own arrival times; with ``rate``, scaled so that their mean rate is ``rate``."""
    times = [trace.arrival_s(index) for index in range(trace.num_requests)]
    scale = 1.0
    if rate and len(times) > 1 and times[-1] > times[0]:
        scale = (len(times) - 1) / (times[-1] - times[0]) / rate
    for index, at in enumerate(times):
        yield at * scale, index


WORKLOADS = ("chat", "long-short", "short-long", "mixed", "trace")


def parse_workload_args(text: str) -> dict[str, str]:
    """``"a=1,b.c=2"`` -> ``{"a": "1", "b.c": "2"}``."""
    pairs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"workload argument {item!r} is not key=value")
        pairs[key.strip()] = value.strip()
    return pairs


def make_workload(name: str, seed: int = 0, args: dict[str, str] | None = None, max_tokens: int | None = None,
                  trace_file: str | None = None) -> Workload:
    """A workload by name, with ``args`` overriding its fields (``mixed`` takes ``part.field`` keys too).

    ``max_tokens`` fixes every request's output length (for a trace: caps it).
    """
    args = dict(args or {})
    if name == "trace":
        if not trace_file:
            raise ValueError("the trace workload needs a trace file (--trace-file)")
        base = TraceWorkload(path=str(trace_file), seed=seed)
        if max_tokens is not None:
            base = dataclasses.replace(base, max_output_len=max_tokens)
        return _override(base, args)
    # A fixed max_tokens pins every output length; prompt lengths keep their spread.
    fixed = {"output_len": str(max_tokens), "output_spread": "0"} if max_tokens is not None else {}
    if name == "chat":
        return _override(ChatWorkload(seed=seed), {**args, **fixed})
    if name in ("long-short", "short-long"):
        base = long_short(seed) if name == "long-short" else short_long(seed)
        return _override(base, {**args, **fixed})
    if name == "mixed":
        part_names = ("chat", "long_short", "short_long")
        unknown = {key for key in args if "." in key and key.split(".", 1)[0] not in part_names}
        if unknown:
            raise ValueError(f"mixed has no part for {sorted(unknown)}; its parts are {', '.join(part_names)}")
        parts = {}
        for field in part_names:
            own = {key.split(".", 1)[1]: value for key, value in args.items() if key.startswith(field + ".")}
            default = {"chat": ChatWorkload(seed=seed), "long_short": long_short(seed),
                       "short_long": short_long(seed)}[field]
            parts[field] = _override(default, {**own, **fixed})
        rest = {key: value for key, value in args.items() if "." not in key}
        return _override(MixedWorkload(seed=seed, **parts), rest)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def _override(workload, args: dict[str, str]):
    fields = {field.name: field for field in dataclasses.fields(workload) if field.name not in ("name", "path")}
    changes = {}
    for key, text in args.items():
        if key not in fields:
            raise ValueError(f"{workload.name} has no setting {key!r}; it has {', '.join(sorted(fields))}")
        current = getattr(workload, key)
        kind = type(current) if current is not None else int
        if isinstance(current, (ChatWorkload, PromptWorkload)):
            raise ValueError(f"set {key}.<field>=..., not {key}=...")
        try:
            changes[key] = kind(text)
        except ValueError:
            raise ValueError(f"{workload.name}: {key}={text!r} is not a {kind.__name__}") from None
    return dataclasses.replace(workload, **changes)
