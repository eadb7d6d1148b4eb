"""The torch backend's wire messages: peer metadata and the control channel.

    torch_peer     what ``local_metadata()`` carries: where the pool is and, for prefill, its store
    torch_connect  decode -> prefill: join a new pairwise group named ``group``
    torch_send     decode -> prefill: send these runs of blocks, run ``i`` with tag ``first_tag + i``
    torch_reply    prefill -> decode: accepted, or why not

``run_lengths`` splits ``block_ids`` into the runs the decode side merged
pairwise (``block_runs``); each run is consecutive ids.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

import msgspec

from transfer.wire import NonEmptyStr, NonNegativeInt, PoolMetadata, PositiveInt, WireMessage

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class TorchPeer(PoolMetadata, frozen=True, kw_only=True):
    """A pool reachable over a pairwise torch.distributed group."""

    KIND: ClassVar[str] = "torch_peer"

    role: Role
    host: str  # where a prefill's store listens
    port: Port
    device: str


class TorchConnect(WireMessage, frozen=True, kw_only=True):
    KIND: ClassVar[str] = "torch_connect"

    decode: NonEmptyStr
    group: NonEmptyStr
    device: str


class TorchSend(WireMessage, frozen=True, kw_only=True):
    KIND: ClassVar[str] = "torch_send"

    decode: NonEmptyStr
    group: str
    request_id: str
    block_ids: tuple[NonNegativeInt, ...]
    run_lengths: tuple[PositiveInt, ...]
    first_tag: NonNegativeInt

    def validate(self) -> None:
        if sum(self.run_lengths) != len(self.block_ids):
            raise ValueError(f"run_lengths {list(self.run_lengths[:8])} do not split {len(self.block_ids)} block ids")
        for start, ids in self._runs():
            if ids != tuple(range(start, start + len(ids))):
                raise ValueError(f"block ids {list(ids[:8])} are not one consecutive run")

    def runs(self) -> list[tuple[int, int]]:
        """``(start, num_blocks)`` of each run."""
        return [(start, len(ids)) for start, ids in self._runs()]

    def _runs(self):
        offset = 0
        for n in self.run_lengths:
            ids = self.block_ids[offset : offset + n]
            yield ids[0], ids
            offset += n


class TorchReply(WireMessage, frozen=True, kw_only=True):
    KIND: ClassVar[str] = "torch_reply"

    ok: bool
    error: str = ""
