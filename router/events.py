"""``CacheEvent``: a change to where a replica holds a block hash, as block pools record it and routers read it.

One type from the block pool to the wire: the engine's pool appends these as
it stores and evicts blocks, ``router.protocol.RoutingStats`` carries them
unchanged, and ``router.cache_feed`` applies them. It needs only msgspec and
``router.tiers``, so the block pool, which never imports torch, can record
them (``router.protocol`` reaches torch through ``transfer``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from router.tiers import Tier


class CacheEvent(msgspec.Struct, frozen=True, array_like=True, gc=False, forbid_unknown_fields=True):
    """A change to where a replica holds a block hash, numbered in order.

    In ``Tier.DEVICE``, ``HOST`` or ``DISK``: ``stored``, the replica's fastest
    copy is now in ``tier`` (a later event for the hash moves it); not
    ``stored``, the replica holds it nowhere. In ``Tier.SHARED``: the block
    entered (``stored``) or left the deployment's shared store, which every
    replica reads; a hash has that state apart from the replica's own (``key``).
    A tier this build does not know fails the decode, naming the field.

    A pool keeps thousands, and ``RoutingStats`` carries them: packed as an
    array, and untracked by the garbage collector (it holds no references).
    """

    seq: Annotated[int, msgspec.Meta(ge=0)]  # transfer.wire's NonNegativeInt, which this module cannot import
    block_hash: bytes
    stored: bool
    tier: Tier = Tier.DEVICE

    @property
    def key(self) -> tuple[bytes, bool]:
        """What a later event replaces: the replica's own copy, or the shared store's."""
        return self.block_hash, self.tier == Tier.SHARED
