"""Reading the routing fields of a pool request without importing the engine.

The ingress sends ``pd.serve.messages.PoolRequest`` (and replicas send each
other ``PoolControl``) as versioned msgpack bytes; the routers need only a few
of their fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transfer.wire import WireError, decode_any_message

ROUTED_KINDS = ("pool_request", "pool_control")


@dataclass(frozen=True)
class RoutingFields:
    request_id: str
    num_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)
    target_replica_id: str | None = None
    exclude_replica_ids: list[str] = field(default_factory=list)


def routing_fields(data: Any) -> RoutingFields | None:
    """The routing fields of an encoded pool request; None for anything else."""
    if not isinstance(data, (bytes, bytearray)):
        return None
    try:
        _, body = decode_any_message(data, ROUTED_KINDS)
    except WireError:  # not ours: route it by policy alone
        return None
    target = body.get("target_replica_id")
    return RoutingFields(
        request_id=str(body.get("request_id", "")),
        num_tokens=len(body.get("token_ids") or []),
        block_hashes=[h for h in body.get("block_hashes") or [] if isinstance(h, bytes)],
        target_replica_id=target if isinstance(target, str) else None,
        exclude_replica_ids=[str(r) for r in body.get("exclude_replica_ids") or []],
    )
