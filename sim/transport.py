"""KV transfers in simulated time: a real ``KVTransport`` whose bytes are modelled, not moved.

The engines' real ``KVConnector`` drives it (leases, pulls of the blocks a
decode replica lacks, completion notifications, fallbacks); the transport's
own checks run as for NIXL (unknown peers, block sizes, ids, empty reads).
Only the time a read takes is modelled, by ``TransferModel``:

    seconds = per_transfer_s + per_descriptor_s * descriptors + bytes / bytes_per_s

where a read's descriptors are its runs of consecutive blocks (one per run
on each side, as the NIXL backend builds them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from sim.clock import EventLoop
from transfer.base import KVTransport, Run, TransferHandle, TransferState
from transfer.wire import PoolMetadata, TransportKind


@dataclass(frozen=True)
class TransferModel:
    """One read's time; ``source`` says where the numbers come from (measured here, or a datasheet)."""

    per_transfer_s: float
    per_descriptor_s: float
    bytes_per_s: float
    source: str = "analytic"

    def __post_init__(self) -> None:
        if self.per_transfer_s < 0 or self.per_descriptor_s < 0 or self.bytes_per_s <= 0:
            raise ValueError(f"transfer model needs costs >= 0 and bytes_per_s > 0: {self}")

    def seconds(self, num_bytes: int, num_descriptors: int) -> float:
        return self.per_transfer_s + self.per_descriptor_s * num_descriptors + num_bytes / self.bytes_per_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> TransferModel:
        return cls(**json.loads(Path(path).read_text()))


# Links that belong to no GPU preset (NVLink and RDMA NICs come with each GPU: sim.hardware.link).
# loopback: bench.kv_transfer measured NIXL over UCX at 2 to 3 GB/s here (README); its fixed costs are assumed.
LINKS = {
    "tcp100": TransferModel(200e-6, 5e-6, 12.5e9, "analytic: 100 Gb/s TCP"),
    "loopback": TransferModel(1e-3, 20e-6, 2.0e9, "NIXL/UCX over loopback on a 2-core VM: bandwidth as "
                              "bench.kv_transfer measured it, fixed costs assumed"),
}


class SimPeer(PoolMetadata, frozen=True, kw_only=True):
    KIND: ClassVar[str] = "sim_peer"


class SimRead(TransferHandle):
    """Done at its modelled end time; given up before it, it is quiesced only once that time passes."""

    def __init__(self, loop: EventLoop, done_s: float):
        self._loop = loop
        self.done_s = done_s
        self._released = False

    def poll(self) -> TransferState:
        if self._released and self._loop.now < self.done_s:
            return TransferState.FAILED
        return TransferState.DONE if self._loop.now >= self.done_s else TransferState.PENDING

    @property
    def error(self) -> str | None:
        return "released" if self._released and self._loop.now < self.done_s else None

    def release(self) -> None:
        self._released = True

    @property
    def given_up(self) -> bool:
        return self._released

    def quiesced(self) -> bool:
        return self._loop.now >= self.done_s


class SimNetwork:
    """Every replica's transport, the loop they share and the link model."""

    def __init__(self, loop: EventLoop, model: TransferModel):
        self.loop = loop
        self.model = model
        self.transports: dict[str, SimTransport] = {}
        self.num_reads = 0
        self.num_bytes = 0

    def transport(self, engine_id: str, on_event: Callable[[], None]) -> SimTransport:
        """A transport for ``engine_id``; ``on_event`` runs when a read of its finishes or a notice reaches it."""
        transport = SimTransport(engine_id, self, on_event)
        self.transports[engine_id] = transport
        return transport

    def notify(self, engine_id: str, notify: str) -> None:
        """Deliver ``notify`` to ``engine_id``'s transport, as its own event (never inside the sender's step)."""
        transport = self.transports.get(engine_id)
        if transport is not None:
            transport.notices.append(notify)
            self.loop.at(self.loop.now, transport.on_event)


class SimTransport(KVTransport[SimPeer]):
    kind = TransportKind.NIXL  # the transport it models

    def __init__(self, engine_id: str, network: SimNetwork, on_event: Callable[[], None]):
        super().__init__(engine_id)
        self.network = network
        self.on_event = on_event
        self.notices: list[str] = []

    def local_metadata(self) -> bytes:
        pool = self._require_pool()
        return SimPeer(name=self.engine_id, block_bytes=self._block_bytes, num_blocks=pool.shape[0]).encode()

    def poll_notifications(self) -> list[str]:
        notices, self.notices = self.notices, []
        return notices

    def close(self) -> None:
        self._closed = True

    def _register(self, kv_cache: torch.Tensor) -> None:
        pass

    def _decode_peer(self, metadata: bytes) -> SimPeer:
        return SimPeer.decode(metadata)

    def _connect_peer(self, peer: SimPeer) -> None:
        pass

    def _forget_peer(self, name: str) -> None:
        pass

    def _notify(self, peer: SimPeer, notify: str) -> None:
        self.network.notify(peer.name, notify)

    def _read(self, peer: SimPeer, runs: list[Run], notify: str) -> TransferHandle:
        network = self.network
        num_bytes = sum(length for _, _, length in runs) * self._block_bytes
        read = SimRead(network.loop, network.loop.now + network.model.seconds(num_bytes, 2 * len(runs)))
        network.num_reads += 1
        network.num_bytes += num_bytes

        def land() -> None:
            if not read.given_up:
                network.notify(peer.name, notify)
            self.on_event()

        network.loop.at(read.done_s, land)
        return read
