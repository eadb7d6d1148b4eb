"""A tensor-parallel group: the collectives one rank's forward pass makes.

Gloo on CPU, NCCL on CUDA. The group is built from its own TCP store and
process-group object, not torch.distributed's process-global default group,
so one process can run several engines (tests, the offline API) and a group
is closed with its engine. ``timeout_s`` bounds every collective: a rank that
died fails its peers' next collective (at once when its sockets close, at the
latest after the timeout), never hangs them.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class TPGroup:
    """Rank ``rank`` of ``size``; rank 0 hosts the store (``port`` 0 picks a free one, see ``.port``)."""

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device, timeout_s: float):
        self.rank = rank
        self.size = size
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, size, rank == 0, timeout, wait_for_workers=False)
        self.port = self.store.port
        self._pg = None
        self._timeout = timeout

    def connect(self) -> None:
        """Join the group: returns once every rank has (within the timeout)."""
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            self._pg = dist.ProcessGroupNCCL(self.store, self.rank, self.size, options)
        else:
            self._pg = dist.ProcessGroupGloo(self.store, self.rank, self.size, self._timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place."""
        self._pg.allreduce([tensor]).wait()
        return tensor

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        """Rows ``input_splits[r]`` of ``tensor`` (in rank order) to rank ``r``; ``output`` takes
        ``output_splits[r]`` rows from each rank ``r``, in rank order. Any split may be 0."""
        self._pg.alltoall_base(output, tensor.contiguous(), output_splits, input_splits,
                               dist.AllToAllOptions()).wait()
        return output

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on each), stacked in rank order: ``[size, *shape]``."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([parts], [tensor.contiguous()]).wait()
        return torch.stack(parts)

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's vocabulary slice side by side on rank 0, ``[rows, vocab_size]``; elsewhere ``logits``."""
        logits = logits.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self._pg.gather([], [logits], options).wait()
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self._pg.gather([parts], [logits], options).wait()
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def close(self) -> None:
        self._pg = None
        self.store = None
