"""What the engine and its cache manager ask of the KV tiers below the device pool, and ``NoTiers``.

An engine always holds a ``Tiers``: ``KVTiers`` (``pd.engine.tiers.tiers``)
when a host tier is configured, else ``NO_TIERS``, which holds nothing, loads
nothing and counts zeros. So the engine never asks whether it has tiers.
Pure Python: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

from pd.engine.tiers.stats import HostTierStats, StoreTierStats, tier_counters

if TYPE_CHECKING:
    from pd.engine.request import Request


class Tiers(Protocol):
    """The tiers' side of the engine's step and of the prefix match."""

    @property
    def host_stats(self) -> HostTierStats:
        """The host tier's live counters (zeros, never changing, without one)."""

    @property
    def num_waiting(self) -> int:
        """Requests held while their blocks load from a lower tier (``begin``)."""

    @property
    def has_pending_work(self) -> bool:
        """Loads or writes in flight: ``poll`` must run even with nothing to step."""

    def begin(self, request: Request) -> bool:
        """Whether ``request`` is held while its blocks load; ``poll`` returns it once they have."""

    def poll(self) -> list[Request]:
        """Between steps: apply the tiers' results; the requests whose loads are done, for the scheduler."""

    def cancel(self, request_id: str) -> bool:
        """Stop a held request's loads; whether it was held."""

    def release(self, request_id: str) -> None:
        """Free what the request's loads reserved (idempotent)."""

    def promote(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
                device_ids: list[int]) -> bool:
        """Copy the run of ``block_hashes`` after ``device_ids`` up into free device blocks; whether any was."""

    def on_cached(self, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """A block was computed and cached on the device."""

    def before_run(self, remote_writes: bool) -> None:
        """After scheduling, before the step writes into reused blocks: their demoted KV's copies go first.

        ``remote_writes``: pulls will write into blocks outside any device stream's order.
        """

    def wait_for_loads(self, timeout_s: float) -> None:
        """With nothing else to run: block until a load's result lands, or ``timeout_s``."""

    def counters(self) -> dict[str, int | float]:
        """The counters under ``EngineStats`` names (``tier_counters``)."""

    def close(self) -> None:
        """Finish the writes queued, then stop."""


class NoTiers:
    """No tier below the device pool: nothing is held, loaded, promoted or written; counters are zeros."""

    host_stats = HostTierStats()
    num_waiting = 0
    has_pending_work = False
    _ZEROS = tier_counters(HostTierStats(), StoreTierStats(), StoreTierStats())

    def begin(self, request: Request) -> bool:
        return False

    def poll(self) -> list[Request]:
        return []

    def cancel(self, request_id: str) -> bool:
        return False

    def release(self, request_id: str) -> None:
        pass

    def promote(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
                device_ids: list[int]) -> bool:
        return False

    def on_cached(self, block_hash: bytes, token_ids: Sequence[int]) -> None:
        pass

    def before_run(self, remote_writes: bool) -> None:
        pass

    def wait_for_loads(self, timeout_s: float) -> None:
        pass

    def counters(self) -> dict[str, int | float]:
        return dict(self._ZEROS)

    def close(self) -> None:
        pass


NO_TIERS: Tiers = NoTiers()
