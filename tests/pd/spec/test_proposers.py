"""The model-free draft proposers: exact drafts on small sequences, brute-force references, the cache's bounds."""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

import pytest

from pd.engine.spec.ngram import MAX_CANDIDATES, NgramProposer
from pd.engine.spec.suffix import SuffixProposer


def _cache(proposer: SuffixProposer, request_id: str, prompt: list[int], output: list[int]) -> None:
    """Run one request through ``proposer``: proposed for once, then finished with ``output``."""
    proposer.propose(request_id, prompt + output, 1)
    proposer.finish(request_id, prompt + output, len(prompt))


# --- ngram ----------------------------------------------------------------------------------------------------------


def test_ngram_takes_the_longest_match_over_a_newer_shorter_one():
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    #            end 2: [1 2 3] matches 3        end 7: [9 2 3] matches 2
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 5, 1, 2, 3]
    assert proposer.propose("a", tokens, 2) == [10, 11]


def test_ngram_takes_the_newest_of_equally_long_matches():
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    tokens = [1, 2, 3, 10, 1, 2, 3, 20, 1, 2, 3]  # both earlier [1 2 3] match 3 tokens (4th: 10, 20 vs 20)
    assert proposer.propose("a", tokens, 3) == [20, 1, 2]


def test_ngram_prompt_lookup_max_caps_the_match_so_the_newest_wins():
    tokens = [1, 2, 3, 10, 9, 2, 3, 20, 1, 2, 3]
    assert NgramProposer(2, 3).propose("a", tokens, 2) == [10, 9]  # [1 2 3] at end 2 is longer
    assert NgramProposer(2, 2).propose("a", tokens, 2) == [20, 1]  # both match 2: the newest


def test_ngram_prompt_lookup_min_rejects_shorter_matches():
    tokens = [5, 2, 3, 10, 1, 2, 3]  # the longest earlier match is [2 3]
    assert NgramProposer(3, 4).propose("a", tokens, 2) == []
    assert NgramProposer(2, 4).propose("a", tokens, 2) == [10, 1]


def test_ngram_draft_is_at_most_k_and_stops_at_the_sequence_end():
    proposer = NgramProposer(2, 4)
    assert proposer.propose("a", [7, 8, 9, 7, 8], 5) == [9, 7, 8]  # runs on into the tail, no further
    assert proposer.propose("b", [7, 8, 9, 6, 7, 8], 1) == [9]
    assert proposer.propose("b", [7, 8, 9, 6, 7, 8], 0) == []


def test_ngram_proposes_nothing_without_a_match():
    proposer = NgramProposer(1, 3)
    assert proposer.propose("a", [], 4) == []
    assert proposer.propose("b", [5], 4) == []
    assert proposer.propose("c", [1, 2, 3, 4, 5], 4) == []


def test_ngram_examines_only_the_newest_candidates():
    """An old long match behind more than MAX_CANDIDATES newer occurrences of the key is not found."""
    old = [1, 2, 3, 4, 5, 6]
    noise = [token for i in range(MAX_CANDIDATES + 1) for token in (4, 5, 100 + i)]
    proposer = NgramProposer(2, 5)
    assert proposer.propose("a", old + noise + [2, 3, 4, 5], 2) == [100 + MAX_CANDIDATES, 2]
    # Within the bound it is found.
    few = noise[-3 * (MAX_CANDIDATES - 2):]
    assert proposer.propose("b", old + few + [2, 3, 4, 5], 2) == [6, 4]


def _ngram_reference(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The longest tail (low..high) found earlier, the newest occurrence: a scan of every position."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1: end + 1] == tail:
                return tokens[end + 1: end + 1 + k]
    return []


@pytest.mark.parametrize("low, high", [(1, 1), (1, 4), (2, 5), (3, 3)])
def test_ngram_grown_token_by_token_matches_a_fresh_proposer_and_a_full_scan(low, high):
    rng = random.Random(low * 10 + high)
    tokens = [rng.randrange(1000) for _ in range(100)]
    while len(tokens) < 300:  # stretches of the first 100 tokens copied again: matches of every length
        if rng.random() < 0.6:
            start = rng.randrange(100)
            tokens += tokens[start: start + rng.randrange(1, 8)]
        else:
            tokens.append(rng.randrange(1000))
    counts: dict[tuple[int, ...], int] = {}
    for end in range(low - 1, len(tokens)):
        key = tuple(tokens[end - low + 1: end + 1])
        counts[key] = counts.get(key, 0) + 1
    assert max(counts.values()) < MAX_CANDIDATES // 2  # a full scan finds what the bounded one does
    grown = NgramProposer(low, high)
    for length in range(len(tokens) + 1):
        prefix = tokens[:length]
        expected = _ngram_reference(prefix, 4, low, high)
        assert grown.propose("r", prefix, 4) == expected, length
        if length % 25 == 0:
            assert NgramProposer(low, high).propose("fresh", prefix, 4) == expected


# --- suffix ---------------------------------------------------------------------------------------------------------


def test_suffix_finds_a_templated_output_of_another_request():
    """Same template, different inputs: only the cache of finished outputs knows how it goes on."""
    template = [900, 901, 902, 903, 904, 905, 906, 907]
    suffix = SuffixProposer()
    _cache(suffix, "a", [1, 2, 3], template)
    ngram = NgramProposer(1, 4)
    new = [40, 41, 42, 43] + template[:3]  # a different prompt, then the template's start
    assert ngram.propose("b", new, 4) == []
    assert suffix.propose("b", new, 4) == [903, 904, 905]  # at most ceil(1.0 x match length 3) tokens
    assert suffix.propose("b", new + [903], 4) == [904, 905, 906, 907]


def test_suffix_also_draws_on_the_request_itself():
    proposer = SuffixProposer(max_cached_tokens=0)
    assert proposer.propose("a", [5, 6, 7, 8, 9, 1, 5, 6, 7], 4) == [8, 9, 1]
    assert proposer.num_cached_sequences == 0


def test_suffix_the_more_frequent_continuation_wins():
    proposer = SuffixProposer(max_spec_factor=4.0)
    for i, ending in enumerate([[50, 51], [60, 61], [60, 61]]):
        _cache(proposer, f"old{i}", [i], [7, 8, 9] + ending)
    assert proposer.propose("b", [100, 7, 8, 9], 4) == [60, 61]
    _cache(proposer, "old3", [3], [7, 8, 9, 50, 51])
    _cache(proposer, "old4", [4], [7, 8, 9, 50, 51])
    assert proposer.propose("c", [100, 7, 8, 9], 4) == [50, 51]


def test_suffix_min_token_prob_stops_the_draft():
    """Four outputs agree on 20, then split four ways: each later token has a share of 1/4."""
    outputs = [[7, 8, 9, 20, 30 + i, 40] for i in range(4)]

    def draft(min_token_prob: float) -> list[int]:
        proposer = SuffixProposer(max_spec_factor=4.0, min_token_prob=min_token_prob)
        for i, output in enumerate(outputs):
            _cache(proposer, f"old{i}", [i], output)
        return proposer.propose("new", [100, 7, 8, 9], 4)

    assert draft(0.3) == [20]
    assert draft(0.25) == [20, 33, 40]  # on a tie, the newest output's token


def test_suffix_share_is_of_all_the_matches_not_of_those_still_agreeing():
    """Ten outputs: 6 go on with 21, and 2 of those with 30. The share of 30 is 2/10, not 2/6."""
    seconds = [21] * 6 + [22] * 4
    thirds = [30, 30, 31, 32, 33, 34] + [40] * 4
    proposer = SuffixProposer(max_spec_factor=4.0, min_token_prob=0.3)
    for i, (second, third) in enumerate(zip(seconds, thirds)):
        _cache(proposer, f"old{i}", [i], [7, 8, 9, 20, second, third])
    assert proposer.propose("new", [100, 7, 8, 9], 4) == [20, 21]


def test_suffix_an_output_that_ends_at_the_match_still_counts():
    proposer = SuffixProposer(max_spec_factor=4.0, min_token_prob=0.15)
    for i in range(9):
        _cache(proposer, f"ends{i}", [i], [1000 + i, 7, 8, 9])
    _cache(proposer, "goes-on", [0], [7, 8, 9, 20])
    assert proposer.propose("new", [100, 7, 8, 9], 4) == []  # 20 has a share of 1/10
    _cache(proposer, "goes-on-again", [0], [7, 8, 9, 20])
    assert proposer.propose("new2", [100, 7, 8, 9], 4) == [20]  # 2/11


def test_suffix_draft_is_at_most_max_spec_factor_times_the_match():
    output = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    for factor, expected_len in [(0.5, 2), (1.0, 3), (2.0, 6)]:
        proposer = SuffixProposer(max_spec_factor=factor)
        _cache(proposer, "old", [0], output)
        assert proposer.propose("new", [100, 7, 8, 9], 8) == output[3: 3 + expected_len]


def test_suffix_max_depth_caps_the_match_and_so_the_draft():
    output = list(range(1, 13))
    for max_depth, expected in [(3, [6, 7, 8]), (24, [6, 7, 8, 9, 10])]:
        proposer = SuffixProposer(max_depth=max_depth)
        _cache(proposer, "old", [0], output)
        assert proposer.propose("new", [1, 2, 3, 4, 5], 8) == expected


def test_suffix_prefers_many_shorter_matches_to_one_longer_one():
    """Arctic's score: one output matching 3 tokens loses to four matching 2 that agree on more tokens."""
    proposer = SuffixProposer(max_spec_factor=4.0)
    _cache(proposer, "long", [0], [5, 8, 9, 1])
    for i in range(4):
        _cache(proposer, f"short{i}", [0], [6, 8, 9, 2, 3, 4, 5, 6])
    # Match 3 [5 8 9]: [1] scores 1. Match 2 [8 9], five voters: 2 3 4 5 6 at 4/5 each, 4.0 > 1.
    assert proposer.propose("new", [5, 8, 9], 8) == [2, 3, 4, 5, 6]


def _suffix_reference(tokens: list[int], outputs: list[list[int]], k: int, max_depth: int,
                      factor: float, min_prob: float) -> list[int]:
    """Every occurrence of the tail in the request and the cached outputs; votes at each match length."""
    last = len(tokens) - 1

    def match(source: list[int], end: int) -> int:
        length = 0
        while length < max_depth and length <= min(end, last) and source[end - length] == tokens[last - length]:
            length += 1
        return length

    candidates = [(match(tokens, end), tokens[end + 1:]) for end in range(last - 1, 0, -1)]
    candidates += [(match(output, end), output[end + 1:]) for output in reversed(outputs)
                   for end in range(len(output) - 1, 0, -1)]
    candidates = sorted((c for c in candidates if c[0] >= 2), key=lambda c: -c[0])
    best, best_score = [], 0.0
    for match_len in sorted({m for m, _ in candidates}, reverse=True):
        voters = [c for m, c in candidates if m >= match_len]
        draft, score, live = [], 0.0, voters
        for position in range(min(k, math.ceil(factor * match_len - 1e-9))):
            counts: dict[int, int] = {}
            for c in live:
                if len(c) > position:
                    counts[c[position]] = counts.get(c[position], 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            if counts[token] / len(voters) < min_prob:
                break
            draft.append(token)
            score += counts[token] / len(voters)
            live = [c for c in live if len(c) > position and c[position] == token]
        if score > best_score:
            best, best_score = draft, score
    return best


@pytest.mark.parametrize("max_depth, factor, min_prob", [(24, 1.0, 0.1), (4, 2.0, 0.3), (6, 0.5, 0.0)])
def test_suffix_grown_token_by_token_matches_a_fresh_proposer_and_a_full_scan(max_depth, factor, min_prob):
    rng = random.Random(max_depth)
    outputs = []
    grown = SuffixProposer(max_depth=max_depth, max_spec_factor=factor, min_token_prob=min_prob)
    fresh = SuffixProposer(max_depth=max_depth, max_spec_factor=factor, min_token_prob=min_prob)
    for i in range(5):
        output = [rng.randrange(8) for _ in range(rng.randrange(3, 20))]
        outputs.append(output)
        _cache(grown, f"old{i}", [], output)
        _cache(fresh, f"old{i}", [], output)
    tokens = [rng.randrange(8) for _ in range(40)]
    for length in range(len(tokens) + 1):
        prefix = tokens[:length]
        expected = _suffix_reference(prefix, outputs, 5, max_depth, factor, min_prob)
        assert grown.propose("r", prefix, 5) == expected, length
        assert fresh.propose(f"fresh{length}", prefix, 5) == expected, length
        fresh.finish(f"fresh{length}", prefix, length)  # an empty output: not cached
    assert fresh.num_cached_sequences == len(outputs)


def test_suffix_eviction_keeps_the_cache_bounded_and_forgets_the_oldest():
    proposer = SuffixProposer(max_cached_tokens=50)
    for i in range(10):
        _cache(proposer, f"r{i}", [0], [1000 * i + j for j in range(20)])
        assert proposer.cached_tokens <= 50
    assert proposer.cached_tokens == 40 and proposer.num_cached_sequences == 2
    assert proposer.propose("new", [1, 8000, 8001, 8002], 2) == [8003, 8004]  # kept
    assert proposer.propose("old", [1, 7000, 7001, 7002], 2) == []  # evicted, with its index entries
    _cache(proposer, "big", [0], list(range(5000, 5100)))  # longer than the cache: its first 50 tokens
    assert proposer.cached_tokens == 50 and proposer.num_cached_sequences == 1
    assert proposer.propose("tail", [1, 5047, 5048], 4) == [5049]
    assert proposer.propose("new2", [1, 8000, 8001, 8002], 2) == []


def test_suffix_caches_no_short_output_and_nothing_with_the_cache_off():
    proposer = SuffixProposer()
    _cache(proposer, "a", [1, 2, 3], [4, 5])  # too short to hold a match and a token after it
    assert proposer.num_cached_sequences == 0
    off = SuffixProposer(max_cached_tokens=0)
    _cache(off, "a", [1, 2, 3], [4, 5, 6, 7])
    assert off.cached_tokens == 0 and off.num_cached_sequences == 0


@pytest.mark.parametrize("output_len, bound", [(3, 64), (100, 48)])
def test_suffix_cache_memory_per_token_is_bounded(output_len, bound):
    """The docstring's bound, measured: the cache filled three times over, every window distinct."""
    max_cached_tokens = 2048
    rng = random.Random(output_len)
    outputs = [[rng.randrange(1 << 20) for _ in range(output_len)]
               for _ in range(3 * max_cached_tokens // output_len)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        proposer = SuffixProposer(max_cached_tokens=max_cached_tokens)
        for i, output in enumerate(outputs):
            proposer.propose("r", output, 0)
            proposer.finish("r", output, 0)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert max_cached_tokens - output_len < proposer.cached_tokens <= max_cached_tokens
    assert proposer.num_requests == 0
    assert used / proposer.cached_tokens <= bound


# --- both -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: NgramProposer(1, 3), SuffixProposer], ids=["ngram", "suffix"])
def test_finish_drops_the_request_and_an_unknown_ids_output_is_still_cached(make):
    proposer = make()
    tokens = [1, 2, 3, 1, 2]
    proposer.propose("a", tokens, 2)
    proposer.propose("b", tokens, 2)
    assert proposer.num_requests == 2
    proposer.finish("a", tokens, 2)
    proposer.finish("never-seen", tokens, 2)  # a request that never drafted: its output teaches the cache too
    assert proposer.num_requests == 1
    proposer.propose("a", [9], 2)  # the id starts afresh: a shorter sequence is no error
    if isinstance(proposer, SuffixProposer):
        assert proposer.num_cached_sequences == 2


@pytest.mark.parametrize("make", [lambda: NgramProposer(1, 3), SuffixProposer], ids=["ngram", "suffix"])
def test_token_ids_may_not_shrink_or_k_be_negative(make):
    proposer = make()
    proposer.propose("a", [1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="only grows"):
        proposer.propose("a", [1, 2, 3], 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        proposer.propose("a", [1, 2, 3, 4], -1)


@pytest.mark.parametrize("make, field", [
    (lambda: NgramProposer(0, 3), "prompt_lookup_min"),
    (lambda: NgramProposer(3, 2), "prompt_lookup_max"),
    (lambda: SuffixProposer(max_depth=1), "max_depth"),
    (lambda: SuffixProposer(max_cached_tokens=-1), "max_cached_tokens"),
    (lambda: SuffixProposer(max_spec_factor=0.0), "max_spec_factor"),
    (lambda: SuffixProposer(min_token_prob=1.5), "min_token_prob"),
    (lambda: SuffixProposer(min_token_prob=-0.1), "min_token_prob"),
])
def test_bad_arguments_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()
