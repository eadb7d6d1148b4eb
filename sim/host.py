"""Replicas that share one machine's cores with the rest of the serving path.

On a small machine the engines compute on the same cores as the HTTP proxy,
the ingress and the load generator, whose work grows with the tokens
streamed and the requests coming in. Work that starts while the cores are
oversubscribed runs slower, by the ratio of demand to cores:

    demand  = threads of every piece of work under way (this one included):
              a replica's step (its threads), the ingress's work on a request (one)
            + cpu_per_token_s * tokens streamed over the last window_s / window_s
    stretch = max(1, demand / cores)

The ingress's work is both: its time stretches, and a step that starts
while it runs is stretched by it. So a request's time to first token rises
with the load on the machine, its own ingress work included.

GPU deployments have no such term (the host's cores are not what computes),
so a ``ClusterSpec`` without a ``HostModel`` has none.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sim.clock import EventLoop


@dataclass(frozen=True)
class HostModel:
    cores: float
    cpu_per_token_s: float  # CPU the proxy, the ingress and the client spend on each streamed token
    window_s: float = 1.0

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.cpu_per_token_s < 0 or self.window_s <= 0:
            raise ValueError(f"a host needs cores > 0, cpu_per_token_s >= 0 and window_s > 0: {self}")


class SharedHost:
    def __init__(self, loop: EventLoop, model: HostModel):
        self.loop = loop
        self.model = model
        self._tokens: deque[tuple[float, int]] = deque()
        self._num_recent_tokens = 0
        self._working: dict[str, int] = {}  # a piece of work under way -> its threads

    def note_tokens(self, count: int) -> None:
        self._tokens.append((self.loop.now, count))
        self._num_recent_tokens += count

    def begin(self, key: str, threads: int) -> float:
        """Work on ``threads`` threads starts (a replica's step, the ingress's work on a request): the factor its
        modelled time stretches by. ``key`` names it until ``end``."""
        self._working[key] = threads
        horizon = self.loop.now - self.model.window_s
        while self._tokens and self._tokens[0][0] < horizon:
            self._num_recent_tokens -= self._tokens.popleft()[1]
        demand = sum(self._working.values()) + (
            self.model.cpu_per_token_s * self._num_recent_tokens / self.model.window_s)
        return max(1.0, demand / self.model.cores)

    def end(self, key: str) -> None:
        self._working.pop(key, None)
