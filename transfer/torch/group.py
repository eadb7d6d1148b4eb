"""Pairwise torch.distributed groups: prefill rank 0, decode rank 1, no global world."""

from __future__ import annotations

import datetime
import logging

import torch
from torch.distributed import ProcessGroupGloo

logger = logging.getLogger(__name__)

PREFILL_RANK, DECODE_RANK = 0, 1
# Tags wrap at this value; a run's tag is (first_tag + i) % TAG_LIMIT.
TAG_LIMIT = 1 << 24


def new_pair_group(store, rank: int, device: torch.device, host: str, timeout: datetime.timedelta):
    """A two-rank group on ``store``: NCCL for CUDA pools, gloo (bound to ``host``) otherwise."""
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, options)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(store, rank, 2, options)


def abort_group(group) -> None:
    """Abort a group's pending operations; idempotent.

    Gloo's abort does not stop receives already posted: only their completion,
    a timed-out wait (gloo then closes the pair), or destroying the group and
    its works ends them.
    """
    if group is None:
        return
    try:
        group.abort()
    except Exception as exc:  # noqa: BLE001 - some builds lack abort; dropping the last reference closes it too
        logger.debug("aborting a process group: %s", exc)
