"""Moving KV blocks between replicas: NIXL and torch.distributed backends, wire messages.

Backends import lazily, so ``import transfer`` works without NIXL installed.
"""

from transfer.base import KVTransport, TransferError, TransferHandle, TransferState, block_runs
from transfer.wire import WIRE_VERSION, KVHandle, LayoutFingerprint, TransportKind, WireError

__all__ = [
    "KVHandle", "KVTransport", "LayoutFingerprint", "TransferError", "TransferHandle", "TransferState",
    "TransportKind", "WIRE_VERSION", "WireError", "block_runs", "create_transport",
]


def create_transport(kind: str, engine_id: str, **options) -> KVTransport:
    """A transport of ``kind`` ("nixl" or "torch") for the engine ``engine_id``."""
    if kind == TransportKind.NIXL:
        from transfer.nixl_backend import NixlTransport

        return NixlTransport(engine_id, **options)
    if kind == TransportKind.TORCH:
        from transfer.torch import TorchTransport

        return TorchTransport(engine_id, **options)
    raise ValueError(f"transfer backend must be 'nixl' or 'torch', got {kind!r}")
