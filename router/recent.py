"""What a router sent each replica recently: request and prefill-token counts that decay per decision. Pure Python."""

from __future__ import annotations

from typing import Sequence


class RecentRouted:
    """Requests and prefill tokens this router sent each replica, decaying by ``1 - 1/window`` per decision.

    A decision costs O(1), not one multiplication per replica: the values
    are kept divided by ``scale`` (the decay since the last renormalisation),
    so decaying everyone is one multiplication of ``scale``.
    """

    # Below this scale, stored values are renormalised before they overflow.
    _MIN_SCALE = 1e-100

    def __init__(self, window: int) -> None:
        self._decay = 1.0 - 1.0 / window
        self._scale = 1.0  # a value is its stored number times this
        self._requests: dict[str, float] = {}
        self._prefill_tokens: dict[str, float] = {}

    def _admit(self, replica_id: str) -> None:
        # A newcomer starts at the mean, so that it is neither flooded nor starved.
        num_known = len(self._requests)
        self._requests[replica_id] = sum(self._requests.values()) / num_known if num_known else 0.0
        self._prefill_tokens[replica_id] = sum(self._prefill_tokens.values()) / num_known if num_known else 0.0

    def requests(self, replica_id: str) -> float:
        if replica_id not in self._requests:
            self._admit(replica_id)
        return self._requests[replica_id] * self._scale

    def prefill_tokens(self, replica_id: str) -> float:
        if replica_id not in self._prefill_tokens:
            self._admit(replica_id)
        return self._prefill_tokens[replica_id] * self._scale

    def requests_of(self, replica_ids: Sequence[str]) -> list[float]:
        """``requests`` of each of ``replica_ids``, in order (newcomers admitted in that order)."""
        stored = self._requests
        for replica_id in replica_ids:
            if replica_id not in stored:
                self._admit(replica_id)
        scale = self._scale
        return [stored[replica_id] * scale for replica_id in replica_ids]

    def record(self, replica_id: str, prefill_tokens: int) -> None:
        if replica_id not in self._requests:
            self._admit(replica_id)
        self._scale *= self._decay
        self._requests[replica_id] += 1.0 / self._scale
        self._prefill_tokens[replica_id] += prefill_tokens / self._scale
        if self._scale < self._MIN_SCALE:
            for values in (self._requests, self._prefill_tokens):
                for key in values:
                    values[key] *= self._scale
            self._scale = 1.0

    def remove(self, replica_id: str) -> None:
        self._requests.pop(replica_id, None)
        self._prefill_tokens.pop(replica_id, None)
