"""Prefill-side leases: a finished prefill's blocks stay pinned until the decode side has them.

Pure Python. A lease ends on the decode side's completion notification, on an
abort, or at its expiry, whichever comes first; ending one twice is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    request_id: str
    expiry: float  # Unix seconds, as carried in the KVHandle


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def pin(self, request_id: str, expiry: float) -> Lease:
        lease = Lease(request_id, expiry)
        self._leases[request_id] = lease
        return lease

    def release(self, request_id: str) -> bool:
        """End a lease; False when it was already gone."""
        return self._leases.pop(request_id, None) is not None

    def expired(self, now: float) -> list[str]:
        return [lease.request_id for lease in self._leases.values() if lease.expiry <= now]
