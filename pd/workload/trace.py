"""Request traces in the Mooncake format, and generators of shared-prefix traffic.

A trace is one JSON object per line:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is the arrival time in milliseconds. ``hash_ids`` name the
prompt's 512-token blocks, ``ceil(input_length / 512)`` of them, the last one
possibly partial. An id stands for a block *and everything before it*: equal
prefixes share leading ids, and an id never reappears after a different prefix.

This is the one reader of the format: the router benchmarks replay traces
through it and ``loadtest``'s trace workload turns its requests into prompts.

Generators (seeded, deterministic):

- ``generate_multi_tenant``: tenants of Zipf popularity, each with its own long
  context (documents, tools, instructions); each request is a turn of a
  conversation over that context, and later turns extend their own history
  (previous prompt + answer + new user message). Conversations start as a
  Poisson process; their turns follow one another after exponential think times.
- ``generate_system_prompt``: every request is one shared system prompt plus
  its own user text, Poisson arrivals. This is the case that pins naive prefix
  routers to one replica.
- ``generate_long_history``: a few very long sessions, each turn re-sending its
  whole history (tens of thousands of tokens), among many short conversations.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Iterable

import msgspec

# Mooncake's published traces hash 512-token blocks.
TRACE_BLOCK_TOKENS = 512

_Count = Annotated[int, msgspec.Meta(ge=0)]


class _MooncakeRecord(msgspec.Struct):
    """One line of a trace as written; other keys on the line are ignored."""

    timestamp: int | float  # milliseconds; an integer stays one, so a trace round-trips unchanged
    input_length: _Count
    output_length: _Count
    hash_ids: list[int]


_record_decoder = msgspec.json.Decoder(_MooncakeRecord)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        })

    @classmethod
    def from_json(cls, line: str | bytes) -> TraceRequest:
        """Decode one line; ``msgspec.DecodeError`` (a ``ValueError``) names the field that is wrong."""
        record = _record_decoder.decode(line)
        return cls(record.timestamp, record.input_length, record.output_length, tuple(record.hash_ids))


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a Mooncake JSONL trace, in file order.

    Raises ``ValueError`` naming the file, the line and the field of the first
    bad record, or saying that the file holds none.
    """
    requests = []
    for line_no, line in enumerate(_read_text(Path(path)).splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(TraceRequest.from_json(line))
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{line_no}: not a Mooncake trace record: {exc}") from None
    if not requests:
        raise ValueError(f"{path}: the trace is empty")
    return requests


def _read_text(path: Path) -> str:
    """The file's text; a ``.gz`` name is gunzipped."""
    if path.suffix == ".gz":
        return gzip.decompress(path.read_bytes()).decode()
    return path.read_text()


def load_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a Mooncake JSONL trace in arrival order (equal timestamps keep file order)."""
    return sorted(read_trace(path), key=lambda request: request.timestamp_ms)


def dump_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write ``requests`` as a Mooncake JSONL trace, one line each, in the order given (gzipped for ``.gz``)."""
    text = "".join(request.to_json() + "\n" for request in requests)
    if Path(path).suffix == ".gz":
        Path(path).write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        Path(path).write_text(text)


def num_blocks(num_tokens: int) -> int:
    return math.ceil(num_tokens / TRACE_BLOCK_TOKENS)


class _BlockIds:
    """Hands out fresh block ids and builds a prompt's ids from a shared prefix.

        prefix:  |  id  |  id  | part|            prefix_len tokens, its full blocks shared
        prompt:  |  id  |  id  | new  | new  |new|  the block holding the prefix's tail is new
    """

    def __init__(self, first_id: int = 0) -> None:
        self._next_id = first_id

    def fresh(self, count: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        return ids

    def extend(self, prefix_ids: list[int], prefix_len: int, prompt_len: int) -> list[int]:
        shared = prefix_ids[: prefix_len // TRACE_BLOCK_TOKENS]
        return shared + self.fresh(num_blocks(prompt_len) - len(shared))


def _check_token_ranges(config, names: tuple[str, ...]) -> None:
    """Each named ``(min, max)`` field of ``config`` is an inclusive range of at least 1 token."""
    for name in names:
        low, high = getattr(config, name)
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be 1 <= min <= max, got {(low, high)}")


def _system_prompt_request(config, rng: random.Random, ids: _BlockIds, system_ids: list[int],
                           timestamp_ms: int) -> TraceRequest:
    """One request of ``config``'s shared system prompt (``system_ids``) plus its own user text."""
    prompt_len = config.system_prompt_tokens + rng.randint(*config.user_tokens)
    prompt_ids = ids.extend(system_ids, config.system_prompt_tokens, prompt_len)
    return TraceRequest(timestamp_ms, prompt_len, rng.randint(*config.output_tokens), tuple(prompt_ids))


@dataclass(frozen=True)
class MultiTenantTraceConfig:
    """Multi-tenant shared-prefix traffic. Token ranges are inclusive (min, max), drawn uniformly.

    Conversations start as a Poisson process at ``rate_per_s / mean turns``, so
    requests arrive at about ``rate_per_s``; each picks a tenant by Zipf
    popularity and has 1 to ``max_turns`` turns, each the previous one's
    arrival plus an exponential think time.
    """

    num_requests: int = 4000
    rate_per_s: float = 10.0
    num_tenants: int = 96
    zipf_s: float = 1.0  # tenant popularity ~ 1 / rank ** zipf_s
    context_tokens: tuple[int, int] = (4096, 12288)  # each tenant's own long context
    user_tokens: tuple[int, int] = (64, 768)  # new user text per turn
    output_tokens: tuple[int, int] = (64, 512)
    max_turns: int = 8
    think_time_s: float = 30.0  # mean gap between a conversation's turns
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_tenants < 1 or self.max_turns < 1:
            raise ValueError("num_requests, num_tenants and max_turns must be >= 1")
        if self.rate_per_s <= 0 or self.zipf_s < 0 or self.think_time_s < 0:
            raise ValueError("rate_per_s must be > 0, zipf_s and think_time_s >= 0")
        _check_token_ranges(self, ("context_tokens", "user_tokens", "output_tokens"))


# Multi-tenant traffic shaped like Mooncake's published traces: prompts of about
# 8-12k tokens on average, mostly reused context, outputs of a few hundred tokens,
# many tenants with a long tail.
MOONCAKE_LIKE = MultiTenantTraceConfig(num_tenants=256, zipf_s=0.8, context_tokens=(2048, 16384),
                                       user_tokens=(128, 2048), output_tokens=(16, 512), max_turns=12,
                                       think_time_s=60.0)


@dataclass
class _Turn:
    arrival_s: float
    conversation: int
    user_len: int
    output_len: int


def generate_multi_tenant(config: MultiTenantTraceConfig = MultiTenantTraceConfig()) -> list[TraceRequest]:
    """Turns of multi-turn conversations over per-tenant contexts, Zipf tenants, Poisson conversation starts."""
    rng = random.Random(config.seed)
    ids = _BlockIds()
    contexts = []  # per tenant: (block ids of its full blocks, length)
    for _ in range(config.num_tenants):
        context_len = rng.randint(*config.context_tokens)
        contexts.append((ids.fresh(context_len // TRACE_BLOCK_TOKENS), context_len))
    popularity = [1.0 / (rank + 1) ** config.zipf_s for rank in range(config.num_tenants)]
    conversation_rate = config.rate_per_s / ((1 + config.max_turns) / 2)

    # Draw conversations until they hold enough turns, then keep the first num_requests to arrive.
    tenant_of: list[int] = []
    turns: list[_Turn] = []
    start_s = 0.0
    while len(turns) < config.num_requests:
        start_s += rng.expovariate(conversation_rate)
        conversation = len(tenant_of)
        tenant_of.append(rng.choices(range(config.num_tenants), weights=popularity)[0])
        arrival_s = start_s
        for turn in range(rng.randint(1, config.max_turns)):
            if turn:
                arrival_s += rng.expovariate(1.0 / config.think_time_s) if config.think_time_s else 0.0
            turns.append(_Turn(arrival_s, conversation, rng.randint(*config.user_tokens), rng.randint(*config.output_tokens)))
    turns.sort(key=lambda turn: turn.arrival_s)
    turns = turns[: config.num_requests]

    # Each conversation's last prompt: (block ids, length, answer length).
    history: dict[int, tuple[list[int], int, int]] = {}
    requests = []
    for turn in turns:
        if turn.conversation in history:
            prefix_ids, prefix_len, answer_len = history[turn.conversation]
            prefix_len_with_answer = prefix_len + answer_len
        else:
            prefix_ids, prefix_len = contexts[tenant_of[turn.conversation]]
            prefix_len_with_answer = prefix_len
        prompt_len = prefix_len_with_answer + turn.user_len
        prompt_ids = ids.extend(prefix_ids, prefix_len, prompt_len)
        history[turn.conversation] = (prompt_ids, prompt_len, turn.output_len)
        requests.append(TraceRequest(int(turn.arrival_s * 1000), prompt_len, turn.output_len, tuple(prompt_ids)))
    return requests


# A long-history trace's many short conversations: small contexts, few turns.
SHORT_CHAT = MultiTenantTraceConfig(num_tenants=256, context_tokens=(256, 2048), user_tokens=(64, 512), max_turns=4)


@dataclass(frozen=True)
class LongHistoryTraceConfig:
    """A few long sessions among short traffic. Token ranges are inclusive (min, max), drawn uniformly.

    ``long_share`` of the requests are turns of ``num_sessions`` Zipf-popular sessions,
    Poisson arrivals over the short traffic's span (at most ``rate_per_s * long_share``).
    A turn re-sends its session's whole history (prompt + answer + ``user_tokens`` of new
    text); a session that would pass ``max_history_tokens`` starts over from ``start_tokens``
    of fresh context, as a client does at its context window. The rest is ``short``
    traffic (its ``num_requests``, ``rate_per_s`` and ``seed`` set from this config's).
    """

    num_requests: int = 2000
    rate_per_s: float = 10.0
    long_share: float = 0.2
    num_sessions: int = 4
    zipf_s: float = 1.0  # session popularity ~ 1 / rank ** zipf_s
    start_tokens: tuple[int, int] = (2048, 8192)
    user_tokens: tuple[int, int] = (256, 2048)  # new text per turn: the user's message, tool results
    output_tokens: tuple[int, int] = (64, 512)
    max_history_tokens: int = 65536
    short: MultiTenantTraceConfig = SHORT_CHAT
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate_per_s <= 0 or self.num_sessions < 1 or self.zipf_s < 0:
            raise ValueError("num_requests, rate_per_s and num_sessions must be positive, zipf_s >= 0")
        if not 0 <= self.long_share < 1 or self.max_history_tokens < self.start_tokens[1] + self.user_tokens[1]:
            raise ValueError("long_share must be in [0, 1), max_history_tokens hold a session's first prompt")
        _check_token_ranges(self, ("start_tokens", "user_tokens", "output_tokens"))


def generate_long_history(config: LongHistoryTraceConfig = LongHistoryTraceConfig()) -> list[TraceRequest]:
    """Short multi-tenant traffic with a few long sessions' turns merged in, in arrival order."""
    num_long = int(config.num_requests * config.long_share)
    short = generate_multi_tenant(replace(
        config.short, num_requests=config.num_requests - num_long,
        rate_per_s=config.rate_per_s * (1 - config.long_share), seed=config.seed))
    rng = random.Random(f"{config.seed}:long-sessions")
    ids = _BlockIds(first_id=1 + max(block_id for request in short for block_id in request.hash_ids))
    popularity = [1.0 / (rank + 1) ** config.zipf_s for rank in range(config.num_sessions)]
    history: dict[int, tuple[list[int], int, int]] = {}  # per session: last prompt's ids, length, answer length
    requests = list(short)
    short_span_s = short[-1].timestamp_ms / 1000
    long_rate = min(config.rate_per_s * config.long_share, num_long / short_span_s if short_span_s else math.inf)
    for timestamp_ms in _arrival_times_ms(num_long, long_rate, rng):
        session = rng.choices(range(config.num_sessions), weights=popularity)[0]
        prefix_ids, prefix_len, answer_len = history.get(session, ([], 0, 0))
        if session not in history or prefix_len + answer_len + config.user_tokens[1] > config.max_history_tokens:
            prefix_ids, prefix_len, answer_len = [], 0, rng.randint(*config.start_tokens)  # fresh context is new text
        prompt_len = prefix_len + answer_len + rng.randint(*config.user_tokens)
        prompt_ids = ids.extend(prefix_ids, prefix_len, prompt_len)
        history[session] = (prompt_ids, prompt_len, rng.randint(*config.output_tokens))
        requests.append(TraceRequest(timestamp_ms, prompt_len, history[session][2], tuple(prompt_ids)))
    return sorted(requests, key=lambda request: request.timestamp_ms)


def _arrival_times_ms(num_requests: int, rate_per_s: float, rng: random.Random) -> list[int]:
    now_s = 0.0
    times = []
    for _ in range(num_requests):
        now_s += rng.expovariate(rate_per_s)
        times.append(int(now_s * 1000))
    return times


@dataclass(frozen=True)
class SystemPromptTraceConfig:
    """Every request shares one system prompt, then has its own user text."""

    num_requests: int = 2000
    rate_per_s: float = 10.0
    system_prompt_tokens: int = 2048
    user_tokens: tuple[int, int] = (64, 2048)
    output_tokens: tuple[int, int] = (64, 512)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate_per_s <= 0 or self.system_prompt_tokens < 1:
            raise ValueError("num_requests, rate_per_s and system_prompt_tokens must be positive")
        _check_token_ranges(self, ("user_tokens", "output_tokens"))


def generate_system_prompt(config: SystemPromptTraceConfig = SystemPromptTraceConfig()) -> list[TraceRequest]:
    """Requests that share one system prompt and nothing else, Poisson arrivals."""
    rng = random.Random(config.seed)
    ids = _BlockIds()
    system_ids = ids.fresh(config.system_prompt_tokens // TRACE_BLOCK_TOKENS)
    requests = []
    for timestamp_ms in _arrival_times_ms(config.num_requests, config.rate_per_s, rng):
        requests.append(_system_prompt_request(config, rng, ids, system_ids, timestamp_ms))
    return requests


@dataclass(frozen=True)
class BurstyTraceConfig:
    """Chat traffic whose rate moves: a diurnal ramp with a load step on top.

    The rate is ``base_rate_per_s`` times a day compressed into
    ``duration_s`` (1 at the ends, ``diurnal_peak`` halfway, a raised cosine),
    times ``step_factor`` from ``step_start`` to ``step_end`` (fractions of the
    duration). Every prompt is one shared system prompt plus its own user text.
    """

    duration_s: float = 600.0
    base_rate_per_s: float = 8.0
    diurnal_peak: float = 2.0
    step_factor: float = 3.0
    step_start: float = 0.2
    step_end: float = 0.35
    system_prompt_tokens: int = 1024
    user_tokens: tuple[int, int] = (256, 4096)
    output_tokens: tuple[int, int] = (128, 1024)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.base_rate_per_s <= 0 or self.diurnal_peak < 1 or self.step_factor <= 0:
            raise ValueError("duration_s and base_rate_per_s must be > 0, diurnal_peak >= 1, step_factor > 0")
        if not 0 <= self.step_start <= self.step_end <= 1:
            raise ValueError(f"need 0 <= step_start <= step_end <= 1, got {self.step_start}, {self.step_end}")
        if self.system_prompt_tokens < 1:
            raise ValueError(f"system_prompt_tokens must be >= 1, got {self.system_prompt_tokens}")
        _check_token_ranges(self, ("user_tokens", "output_tokens"))

    def rate_per_s(self, t_s: float) -> float:
        phase = t_s / self.duration_s
        diurnal = 1 + (self.diurnal_peak - 1) * (1 - math.cos(2 * math.pi * phase)) / 2
        step = self.step_factor if self.step_start <= phase < self.step_end else 1.0
        return self.base_rate_per_s * diurnal * step


def generate_bursty(config: BurstyTraceConfig = BurstyTraceConfig()) -> list[TraceRequest]:
    """Arrivals of a Poisson process of rate ``config.rate_per_s(t)`` (by thinning), shared system prompt."""
    rng = random.Random(config.seed)
    ids = _BlockIds()
    system_ids = ids.fresh(config.system_prompt_tokens // TRACE_BLOCK_TOKENS)
    peak = config.base_rate_per_s * config.diurnal_peak * max(1.0, config.step_factor)
    requests, now_s = [], 0.0
    while True:
        now_s += rng.expovariate(peak)
        if now_s >= config.duration_s:
            return requests
        if rng.random() * peak > config.rate_per_s(now_s):
            continue
        requests.append(_system_prompt_request(config, rng, ids, system_ids, int(now_s * 1000)))
