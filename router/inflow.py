"""The prefill work this router has been sending each replica lately, as a fraction of the replica's time.

    inflow(r) = Σ compute_s of the prompts sent to r, each decayed by 2^(-age / half_life_s),
                over half_life_s / ln 2 (the span such a sum covers)

A prompt that hits a cached prefix goes where the prefix is, so a
replica's recent inflow is, for the most part, what its cached sessions
keep bringing: the work that will keep arriving there. A long session's
turns each prefill a new tail against its whole history, and a session
started there brings its later turns too, so a replica holding long
sessions has a high inflow however short its queue is between turns. The
predicted-latency router (``router.latency``) charges a prompt its own
prefill times ``w_follow`` times this inflow: a long prompt nobody holds,
which starts a session, goes where the least work keeps arriving, which
keeps long sessions apart (Ray's prefix router sends such a prompt to the
replica with the least cached text for the same reason); a turn of a
cached session computes little, so its holder keeps it.

Pure Python; not thread-safe (a router calls it from its one event loop).
"""

from __future__ import annotations

import math


class Inflow:
    """Per replica, the decayed sum of the prefill seconds sent to it, read as a rate (module docstring).

    Any amount keyed by anything hashable reads the same way: flow control keeps the tokens each tenant's
    requests bring to each band (``router.flow_control``)."""

    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self._span_s = half_life_s / math.log(2)
        self._sums: dict[str, tuple[float, float]] = {}  # per replica: (decayed sum of seconds, as of when)

    def sent(self, replica_id: str, compute_s: float, now_s: float) -> None:
        self._sums[replica_id] = (self._decayed(replica_id, now_s) + compute_s, now_s)

    def fraction(self, replica_id: str, now_s: float) -> float:
        """Prefill seconds sent per second lately: 0 for a replica sent nothing."""
        return self._decayed(replica_id, now_s) / self._span_s

    def forget(self, replica_id: str) -> None:
        self._sums.pop(replica_id, None)

    def _decayed(self, replica_id: str, now_s: float) -> float:
        total, at_s = self._sums.get(replica_id, (0.0, now_s))
        return total * 0.5 ** (max(0.0, now_s - at_s) / self.half_life_s)
