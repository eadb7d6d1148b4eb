"""Prompt lookup ("ngram" drafts): continue the sequence as it went on the last time its tail appeared.

No model. The draft for a request is what followed the most recent earlier
occurrence of the longest tail of its own tokens, that tail being
``prompt_lookup_min`` to ``prompt_lookup_max`` tokens long (vLLM's "ngram"
method):

    token_ids:  ... a b c d x y z ... a b c d
                    ^^^^^^^ earlier   ^^^^^^^ tail (n = 4)
    draft:                  x y z     (up to k tokens; it may run on into the tail itself)

Each request keeps an ``NgramIndex`` of its tokens, extended by the tokens
that arrived since its last call, so a call costs O(new tokens + candidates x
prompt_lookup_max), not O(len(token_ids)). ``NgramIndex`` is also what the
suffix proposer (``pd.engine.spec.suffix``) indexes with.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

# A token between two sequences held in one index. It equals no token id, so neither a match
# (compared backwards) nor a continuation (read forwards) runs across it.
SEQUENCE_BREAK = -1
# A link with no earlier window behind it. It is below every base, so it ends a chain.
NO_POSITION = -1
# The smallest bucket table, so a short request does not pay for a large one.
MIN_BUCKETS = 64
# match_length counts up to this many equal tokens one by one (varied text rarely matches more), then
# measures the rest at C speed.
_SHORT_MATCH = 4
# How many earlier occurrences of the last prompt_lookup_min tokens a proposal examines, newest first.
MAX_CANDIDATES = 32


class NgramIndex:
    """Where each window of ``key_len`` tokens ends, newest first: a hash chain, as in LZ77's match finders.

        tokens:  t0 t1 t2 t3 t4 t5 ...   int32; SEQUENCE_BREAK between sequences
        links:   -  .  .  p  .  q  ...   links[i]: the previous position whose window hashed to the same
                                          bucket as the window ending at i (NO_POSITION if none)
        heads:   bucket -> the newest position whose window hashed there

    A window is the ``key_len`` tokens ending at a position; one that holds a
    SEQUENCE_BREAK, or starts before the index's first token, is not linked.
    Buckets collide, so a chain may hold other windows: callers verify tokens
    (``match_length``) and count every position they walk against their bound.

    Positions are global: dropping the oldest tokens (``evict_front``) only
    advances ``base``, and a link below ``base`` ends its chain, so eviction
    touches neither the heads nor the links that remain. Local index ``i``
    into ``tokens`` is global position ``base + i``.

    Memory per live token (a SEQUENCE_BREAK counts as one): 4 bytes of token,
    8 of link, and 16 to 32 of heads (the table doubles once live tokens would
    fill more than half of it, and never shrinks). With the arrays' growth
    slack (1/16) that is at most 45 bytes, and no Python object per token.
    """

    def __init__(self, key_len: int) -> None:
        if key_len < 1:
            raise ValueError(f"key_len must be >= 1, got {key_len}")
        self.key_len = key_len
        self.tokens = array("i")
        self.base = 0
        self._links = array("q")
        self._heads = array("q", [NO_POSITION]) * MIN_BUCKETS

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the current sequence and link their windows."""
        start = len(self.tokens)
        self.tokens.extend(array("i", token_ids))  # converted first: a bad id raises before anything changes
        self._links.extend(array("q", [NO_POSITION]) * (len(self.tokens) - start))
        if 2 * len(self.tokens) > len(self._heads):
            self._rehash()
        else:
            self._link(start, len(self.tokens))

    def extend_to(self, token_ids: Sequence[int]) -> None:
        """Index the tokens of a growing sequence past those already held (an index of one sequence)."""
        if len(token_ids) < len(self.tokens):
            raise ValueError(f"token_ids only grows between calls: {len(self.tokens)} tokens indexed, "
                             f"{len(token_ids)} given")
        if len(token_ids) > len(self.tokens):
            self.extend(token_ids[len(self.tokens):])

    def end_sequence(self) -> None:
        """Close the current sequence: what is appended next starts a new one."""
        self.extend((SEQUENCE_BREAK,))

    def evict_front(self, num_tokens: int) -> None:
        """Drop the oldest ``num_tokens`` tokens (whole sequences, with their breaks, so no window is cut)."""
        if not 0 <= num_tokens <= len(self.tokens):
            raise ValueError(f"num_tokens must be in [0, {len(self.tokens)}], got {num_tokens}")
        del self.tokens[:num_tokens]
        del self._links[:num_tokens]
        self.base += num_tokens

    def latest(self, window: Sequence[int], limit: int) -> list[int]:
        """Local ends of up to ``limit`` windows that may equal ``window`` (``key_len`` tokens), newest first."""
        return self._walk(self._heads[hash(tuple(window)) & (len(self._heads) - 1)], limit)

    def earlier(self, end: int, limit: int) -> list[int]:
        """Local ends of up to ``limit`` windows before local ``end`` that may equal the one ending there."""
        return self._walk(self._links[end], limit)

    def _walk(self, position: int, limit: int) -> list[int]:
        ends: list[int] = []
        base, links = self.base, self._links
        while position >= base and len(ends) < limit:
            ends.append(position - base)
            position = links[position - base]
        return ends

    def _rehash(self) -> None:
        num_buckets = len(self._heads)
        while num_buckets < 2 * len(self.tokens):
            num_buckets *= 2
        self._heads = array("q", [NO_POSITION]) * num_buckets
        self._links = array("q", [NO_POSITION]) * len(self.tokens)
        self._link(0, len(self.tokens))

    def _link(self, start: int, stop: int) -> None:
        """Link the windows ending at local positions ``start`` to ``stop - 1``, oldest first."""
        n = self.key_len
        first = max(start, n - 1)
        if first >= stop:
            return
        tokens, links, heads, base = self.tokens, self._links, self._heads, self.base
        mask = len(heads) - 1
        # windows[i - first] = tokens[i - n + 1 : i + 1], built by zip at C speed.
        windows = zip(*(tokens[first - n + 1 + j: stop - n + 1 + j] for j in range(n)))
        for i, window in enumerate(windows, first):
            if SEQUENCE_BREAK in window:
                continue
            bucket = hash(window) & mask
            links[i] = heads[bucket]
            heads[bucket] = base + i


def match_length(tokens: array, end: int, tail: array) -> int:
    """How many tokens ending at ``tokens[end]`` equal the last ones of ``tail`` (at most ``len(tail)``).

    Both are int32 arrays; ``tail`` holds no SEQUENCE_BREAK, so a match stops at one in ``tokens``.
    """
    limit = min(len(tail), end + 1)
    window = tokens[end - limit + 1: end + 1]
    pattern = tail if limit == len(tail) else tail[len(tail) - limit:]
    if window == pattern:
        return limit
    length = 0  # the windows differ, so this stops within them
    while length < _SHORT_MATCH and window[-1 - length] == pattern[-1 - length]:
        length += 1
    if length < _SHORT_MATCH:
        return length
    # A longer match, measured without a Python loop over its tokens. Read as big-endian integers, equal tokens
    # at the ends of the windows are equal low-order bytes, so zero bits at the low end of their XOR: 32 per
    # equal token, then fewer than 32 (whatever the byte order within a token).
    difference = int.from_bytes(window, "big") ^ int.from_bytes(pattern, "big")
    return ((difference & -difference).bit_length() - 1) // 32


class NgramProposer:
    """Prompt-lookup drafts from each request's own tokens (see the module docstring).

    The sequence's last ``prompt_lookup_min`` tokens key the index. Of their
    earlier occurrences only the ``MAX_CANDIDATES`` newest are examined, each
    extended backwards up to ``prompt_lookup_max`` tokens, so a call's lookup
    costs O(MAX_CANDIDATES x prompt_lookup_max) whatever the sequence's length
    (an older, longer match behind them is missed). Of the longest matches
    found, the newest wins.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min ({prompt_lookup_min}), "
                             f"got {prompt_lookup_max}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    @property
    def num_requests(self) -> int:
        """Requests with an index held (proposed for, not yet finished)."""
        return len(self._indexes)

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the newest earlier occurrence of the longest tail; [] if none."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.prompt_lookup_min)
        index.extend_to(token_ids)
        tokens = index.tokens
        last = len(tokens) - 1
        if k == 0 or last < self.prompt_lookup_min:  # an earlier occurrence needs min + 1 tokens
            return []
        tail = tokens[max(0, last + 1 - self.prompt_lookup_max):]
        best_end, best_len = 0, 0
        for end in index.earlier(last, MAX_CANDIDATES):
            length = match_length(tokens, end, tail)
            if length > best_len:
                best_end, best_len = end, length
                if length == self.prompt_lookup_max:
                    break
        if best_len < self.prompt_lookup_min:  # only bucket collisions, or nothing, were found
            return []
        return tokens[best_end + 1: best_end + 1 + k].tolist()

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop the request's index; an unknown id is ignored."""
        self._indexes.pop(request_id, None)
