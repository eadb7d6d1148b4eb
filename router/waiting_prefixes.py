"""What a replica's report overstates about its queue, from the cached prefixes this router sent it.

A replica reports the prompt work it has not computed
(``RoutingStats.num_waiting_tokens`` and ``num_waiting_pairs``). A request
still waiting for admission has not had its prefix matched yet, so the
report counts its whole prompt: the 30k-token turn of a session whose
29k-token history the replica holds counts as 30k tokens and 30k²/2 pairs,
where the replica will compute its last 1k. Two such turns queued made a
holder look seconds behind, and the predicted-latency router recomputed the
next turn (20k tokens) on an idle replica: 0.93 s, where the holder would
have taken a few tenths (``bench.router_matrix``, long histories).

This router knows, for what it sent, the tokens the prefix index said the
replica holds. The replica admits its waiting requests first come, first
served (within a priority), so its ``num_waiting`` requests are its latest
arrivals; the router takes its own latest sends to that replica, at most
that many, and removes from the report what each counts beyond its
uncached part:

    tokens  -= matched
    pairs   -= n (n + 1) / 2 - prefill_pairs(n - matched, matched)      n: the prompt's tokens

What other ingress replicas sent stays counted whole (they are not seen
here), which overstates the queue, never understates it. Older sends were
admitted (their prefix is matched and the report counts them right), so
they are dropped.

Pure Python; not thread-safe (a router calls it from its one event loop).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from router.step_cost import prefill_pairs

# Sends kept per replica: more than a replica's waiting queue holds between two reports in any pool measured.
MAX_TRACKED_SENDS = 256


@dataclass(frozen=True)
class Overstated:
    """What a report counts, of its waiting requests, that the replica will not compute."""

    num_tokens: int = 0
    num_pairs: int = 0


class WaitingPrefixes:
    """This router's latest sends to each replica, with the prompt tokens the replica held for each."""

    def __init__(self, max_tracked: int = MAX_TRACKED_SENDS) -> None:
        self._sends: dict[str, deque[tuple[int, int]]] = {}  # per replica: (prompt tokens, matched tokens)
        self._max_tracked = max_tracked

    def sent(self, replica_id: str, num_prompt_tokens: int, matched_tokens: int) -> None:
        sends = self._sends.get(replica_id)
        if sends is None:
            sends = self._sends[replica_id] = deque(maxlen=self._max_tracked)
        sends.append((num_prompt_tokens, min(matched_tokens, num_prompt_tokens)))

    def overstated(self, replica_id: str, num_waiting: int) -> Overstated:
        """What ``replica_id``'s report, with ``num_waiting`` requests waiting, counts beyond their uncached
        work (module docstring); forgets the sends admitted since."""
        sends = self._sends.get(replica_id)
        if not sends:
            return Overstated()
        while len(sends) > num_waiting:
            sends.popleft()
        num_tokens = num_pairs = 0
        for num_prompt_tokens, matched in sends:
            num_tokens += matched
            num_pairs += prefill_pairs(num_prompt_tokens, 0) - prefill_pairs(num_prompt_tokens - matched, matched)
        return Overstated(num_tokens, num_pairs)

    def forget(self, replica_id: str) -> None:
        self._sends.pop(replica_id, None)
