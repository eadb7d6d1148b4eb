"""Suffix decoding: drafts from the request's own tokens and from the replica's recent outputs.

No model (SuffixDecoding, arXiv 2411.04975, as Arctic Inference runs it). It draws on two sources:

- the request's own tokens: its prompt, then its output so far;
- a shared cache of the outputs of the requests this replica finished. An
  output that repeats across requests (templated or agentic traffic) is then
  found by the next request that starts to write it.

A proposal takes three steps:

1. The candidates are the occurrences of the sequence's last ``KEY_LEN`` tokens
   in either source, the newest ``MAX_CANDIDATES`` per source. Each is extended
   backwards to its match length ``m``, at most ``max_depth`` tokens.
2. For each distinct match length ``L``, longest first, the candidates matching
   at least ``L`` tokens vote. The draft takes their most frequent next token.
   It then takes the most frequent token after that among the candidates that
   agree, and so on. It goes on while the share of the candidates that agree
   with the whole draft is at least ``min_token_prob``. It stops at
   ``min(k, ceil(max_spec_factor * L))`` tokens. A candidate that has run out
   of tokens still counts among those that vote.
3. A draft scores the sum of those shares, its expected accepted length. The
   best score wins, and on a tie the longer match wins (Arctic's rule).

       candidates matching [q a b]:   ... q a b x y z        draft   x     y     z
                                      ... q a b x y w        share   3/3   2/3   1/3
                                      ... q a b x v  (ends)

The shared cache keeps whole outputs, oldest first, within
``max_cached_tokens`` tokens. A new output evicts the oldest outputs (and
their index entries with them) until it fits. One ``NgramIndex`` holds all
the outputs. An output of ``n`` tokens takes ``n + 1`` entries (with its
``SEQUENCE_BREAK``) of at most 45 bytes each (``NgramIndex``), plus 8 bytes
for its length. Per cached token that is at most ``45 * (n + 1) / n + 8 / n``
bytes:

- 63 bytes for the shortest outputs kept (``MIN_CACHED_OUTPUT_LEN``, 3
  tokens); measured with tracemalloc, 51 to 61;
- 46 bytes for outputs of 100 tokens; measured, 29 to 45, depending on where
  the bucket table's doubling falls.

``tests/pd/spec/test_proposers.py`` measures it. A request's own index takes
at most 45 bytes per token until the request finishes (measured, 29 to 39).

Cost of one call, with ``C <= 2 * MAX_CANDIDATES`` candidates:

- O(new tokens) to index what arrived since the last call;
- O(C * (max_depth + k)) to match and read continuations;
- O(lengths * k * C) at worst to vote. It is usually far less: one
  continuation shared by many candidates votes once with their count, and a
  draft scoring ``s`` skips every shorter length that could not reach ``s``.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Sequence
from itertools import compress
from operator import itemgetter

from pd.engine.spec.ngram import SEQUENCE_BREAK, NgramIndex, match_length

# The tokens that key the index, so also the shortest match that proposes.
KEY_LEN = 2
# How many occurrences of the last KEY_LEN tokens a proposal examines in each source, newest first.
MAX_CANDIDATES = 16
# An output too short to hold a match with a token after it is not cached.
MIN_CACHED_OUTPUT_LEN = KEY_LEN + 1
# Pads a continuation that ran out (its sequence ended) to its draft length. It equals no token id,
# and is SEQUENCE_BREAK itself, so a continuation read across the end of a cached output runs out there.
RAN_OUT = SEQUENCE_BREAK
# max_spec_factor * L is a float: 0.1 * 30 is 3.0000000000000004, whose ceiling would be 4.
_CEIL_SLACK = 1e-9

# One candidate: its match length, and the tokens after it (at most its draft length).
_Candidate = tuple[int, tuple[int, ...]]


class OutputCache:
    """Finished requests' outputs, oldest first, at most ``max_tokens`` tokens in all, in one index."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.index = NgramIndex(KEY_LEN)
        self._output_lens: deque[int] = deque()
        self.num_tokens = 0

    @property
    def num_outputs(self) -> int:
        return len(self._output_lens)

    def insert(self, output_ids: Sequence[int]) -> None:
        """Cache an output, its first ``max_tokens`` tokens if longer, evicting the oldest outputs to fit."""
        output_ids = output_ids[: self.max_tokens]
        if len(output_ids) < MIN_CACHED_OUTPUT_LEN:
            return
        num_evicted = 0  # index entries: tokens and one break per output
        while self.num_tokens + len(output_ids) > self.max_tokens:
            output_len = self._output_lens.popleft()
            self.num_tokens -= output_len
            num_evicted += output_len + 1
        self.index.evict_front(num_evicted)
        self.index.extend(output_ids)
        self.index.end_sequence()
        self._output_lens.append(len(output_ids))
        self.num_tokens += len(output_ids)


class SuffixProposer:
    """Suffix-decoding drafts from each request's tokens and a bounded cache of outputs (see the module docstring).

    ``max_depth``: the longest match looked for, in tokens.
    ``max_cached_tokens``: the shared cache's size in output tokens; 0 turns it off.
    ``max_spec_factor``: a draft is at most ``ceil(max_spec_factor * match length)`` tokens.
    ``min_token_prob``: the least share of the matches that must agree with the whole draft.
    """

    def __init__(self, max_depth: int = 24, max_cached_tokens: int = 65536, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        if max_depth < KEY_LEN:
            raise ValueError(f"max_depth must be >= {KEY_LEN} (the shortest match), got {max_depth}")
        if max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be >= 0 (0: no shared cache), got {max_cached_tokens}")
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, NgramIndex] = {}
        self._cache = OutputCache(max_cached_tokens)
        # By match length: the longest draft it allows, before k.
        self._draft_lens = [math.ceil(max_spec_factor * length - _CEIL_SLACK) for length in range(max_depth + 1)]

    @property
    def cached_tokens(self) -> int:
        """Output tokens in the shared cache (at most ``max_cached_tokens``)."""
        return self._cache.num_tokens

    @property
    def num_cached_sequences(self) -> int:
        """Outputs in the shared cache."""
        return self._cache.num_outputs

    @property
    def num_requests(self) -> int:
        """Requests with an index held (proposed for, not yet finished)."""
        return len(self._requests)

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids``; [] when nothing matches."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        index = self._requests.get(request_id)
        if index is None:
            index = self._requests[request_id] = NgramIndex(KEY_LEN)
        index.extend_to(token_ids)
        pattern = index.tokens
        last = len(pattern) - 1
        if k == 0 or last < KEY_LEN - 1:
            return []
        candidates: list[_Candidate] = []
        tail = pattern[max(0, last + 1 - self.max_depth):]
        self._collect(candidates, pattern, index.earlier(last, MAX_CANDIDATES), tail, k)
        cache = self._cache.index
        cache_ends = cache.latest(pattern[last + 1 - KEY_LEN:], MAX_CANDIDATES)
        self._collect(candidates, cache.tokens, cache_ends, tail, k)
        return self._draft(candidates, k)

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop the request's index and cache its output, also that of a request never proposed for (one that
        did not speculate still teaches the cache). Called once per request (``Speculator.finish``)."""
        self._requests.pop(request_id, None)
        if not 0 <= num_prompt_tokens <= len(token_ids):
            raise ValueError(f"num_prompt_tokens must be in [0, {len(token_ids)}], got {num_prompt_tokens}")
        self._cache.insert(token_ids[num_prompt_tokens:])

    def _collect(self, candidates: list[_Candidate], tokens: array, ends: list[int], tail: array, k: int) -> None:
        """Append the candidates ending at ``ends`` in ``tokens`` that truly match (buckets collide)."""
        draft_lens = self._draft_lens
        for end in ends:
            match_len = match_length(tokens, end, tail)
            if match_len < KEY_LEN:
                continue
            draft_len = min(k, draft_lens[match_len])
            continuation = tuple(tokens[end + 1: end + 1 + draft_len])  # a SEQUENCE_BREAK in it reads as RAN_OUT
            if len(continuation) < draft_len:
                continuation += (RAN_OUT,) * (draft_len - len(continuation))
            candidates.append((match_len, continuation))

    def _draft(self, candidates: list[_Candidate], k: int) -> list[int]:
        """The best-scoring draft over the match lengths, longest first (steps 2 and 3 of the module docstring)."""
        candidates.sort(key=itemgetter(0), reverse=True)  # stable: own before cached, newest first, per length
        votes: dict[tuple[int, ...], int] = {}  # continuation -> how many voters have it, in order of first vote
        best: list[int] = []
        best_score = 0.0
        num_voters = 0
        while num_voters < len(candidates):
            match_len = candidates[num_voters][0]
            while num_voters < len(candidates) and candidates[num_voters][0] == match_len:
                continuation = candidates[num_voters][1]
                votes[continuation] = votes.get(continuation, 0) + 1
                num_voters += 1
            max_len = min(k, self._draft_lens[match_len])
            if best_score >= max_len:  # a draft scores at most its length, and shorter matches allow no more
                break
            draft, score = _vote(votes, num_voters, max_len, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best


def _vote(votes: dict[tuple[int, ...], int], num_voters: int, max_len: int,
          min_token_prob: float) -> tuple[list[int], float]:
    """The most frequent path through the continuations, and its score (the sum of its tokens' shares).

    Each continuation holds at least ``max_len`` tokens, padded with RAN_OUT.
    A share is of all the voters, so a continuation that runs out, or leaves
    the draft, stops counting but still weighs in every later share. Where
    the continuations left all agree (templated text), a position costs a few
    calls at C speed.
    """
    continuations = list(votes)
    counts = list(votes.values())
    num_agreeing = num_voters
    draft: list[int] = []
    score = 0.0
    for position in range(max_len):
        if len(continuations) == 1:  # the rest of the one continuation left, every token at its share
            share = num_agreeing / num_voters
            if share >= min_token_prob:
                rest = continuations[0][position:max_len]
                if RAN_OUT in rest:
                    rest = rest[: rest.index(RAN_OUT)]
                draft.extend(rest)
                score += share * len(rest)
            break
        column = list(map(itemgetter(position), continuations))
        if len(set(column)) == 1:
            token = column[0]
        else:
            token_counts: dict[int, int] = {}
            for token, count in zip(column, counts):
                token_counts[token] = token_counts.get(token, 0) + count
            token_counts.pop(RAN_OUT, None)
            if not token_counts:
                break
            token = max(token_counts, key=token_counts.__getitem__)  # on a tie, the longest then newest match's
            num_agreeing = token_counts[token]
            agrees = [other == token for other in column]
            continuations = list(compress(continuations, agrees))
            counts = list(compress(counts, agrees))
        share = num_agreeing / num_voters
        if token == RAN_OUT or share < min_token_prob:
            break
        draft.append(token)
        score += share
    return draft, score
