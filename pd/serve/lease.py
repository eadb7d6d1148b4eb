"""A remote prefill's pinned blocks, as the ingress holds them: released exactly once."""

from __future__ import annotations

from typing import Protocol

from pd.engine.request import KVSource
from pd.serve.protocol import PrefillResult


class LeaseReleaser(Protocol):
    def release_lease(self, result: PrefillResult) -> None:
        """Ask the prefill replica of ``result`` to free its pinned blocks now."""


class Lease:
    """A remote prefill's pinned blocks, released exactly once (``with`` ends it).

    The decode replica's first chunk settles it: a pull (``KVSource.REMOTE``)
    makes the prefill replica free the blocks itself; anything else releases
    them now.
    """

    def __init__(self, client: LeaseReleaser, result: PrefillResult):
        self._client = client
        self.result = result
        self._open = True

    def settle(self, kv_source: KVSource) -> None:
        if kv_source is KVSource.REMOTE:
            self._open = False
        else:
            self.release()

    def release(self) -> None:
        if self._open:
            self._open = False
            self._client.release_lease(self.result)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
