"""How many blocks the KV pool gets: the config's count or bytes, or a share of a CUDA device's memory.

``num_blocks`` wins, then ``kv_cache_bytes``. Without either, a CUDA engine
takes ``gpu_memory_utilization`` of its device, as vLLM does: once its
weights are in, a profile (``pd.engine.kv_profile``) measures what the
engine needs beside the pool, and the pool gets the rest of the share, but
never more than the device has free (other processes hold the rest):

    device:  |<------------------------------- total ------------------------------->|
             |<------------------ total * utilization ------------------>|
             | in_use (weights, buffers) | activations | graphs |   KV   |  (slack)  |
                                         |<--------- free now, at most --------->|

Off CUDA the pool is ``DEFAULT_KV_CACHE_BYTES``. The arithmetic is here,
pure, over the figures the profile measured, so it is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pd.config import DEFAULT_KV_CACHE_BYTES, EngineConfig


@dataclass(frozen=True)
class DeviceShare:
    """The pool is what ``utilization`` of each rank's device leaves once the model is loaded and profiled."""

    utilization: float


@dataclass(frozen=True)
class DeviceMemory:
    """One rank's device, in bytes, measured once its weights are in and before its pool exists."""

    total: int
    free: int  # free on the device now (the profile's memory given back): what this pool can have at most
    in_use: int  # what this engine took since it started: weights, buffers, libraries' workspaces
    peak_activations: int  # the largest step's temporaries beside the weights: its forward and sampling
    graph_reserve: int  # what the decode CUDA graphs' memory pool will hold; 0 without graphs

    def kv_bytes(self, utilization: float) -> int:
        """What the pool may take: the share's rest, within what is free beside the steps' needs (< 0: none)."""
        steps = self.peak_activations + self.graph_reserve
        return min(int(self.total * utilization) - self.in_use - steps, self.free - steps)


def sized_from_device(config: EngineConfig) -> bool:
    """Whether the pool takes ``gpu_memory_utilization`` of the device: CUDA, without a count or bytes."""
    return (config.num_blocks is None and config.kv_cache_bytes is None
            and config.device.partition(":")[0] == "cuda")


def pool_size(config: EngineConfig, block_bytes: int) -> int | DeviceShare:
    """The pool's blocks of ``block_bytes`` as the config gives them, or the device's share to fill."""
    if config.num_blocks is not None:
        return config.num_blocks
    if sized_from_device(config):
        return DeviceShare(config.gpu_memory_utilization)
    kv_bytes = DEFAULT_KV_CACHE_BYTES if config.kv_cache_bytes is None else config.kv_cache_bytes
    return max(1, kv_bytes // block_bytes)


def kv_cache_blocks(ranks: Sequence[DeviceMemory], utilization: float, block_bytes: int, min_blocks: int) -> int:
    """The blocks of ``block_bytes`` every rank's pool gets: the fewest any rank's device has room for.

    ``ValueError`` naming ``gpu_memory_utilization`` when that is fewer than
    ``min_blocks``, the blocks of one request of ``max_model_len`` tokens.
    """
    fits = [max(0, memory.kv_bytes(utilization)) // block_bytes for memory in ranks]
    num_blocks = min(fits)
    if num_blocks < min_blocks:
        rank = fits.index(num_blocks)
        raise ValueError(_no_room(ranks[rank], rank if len(ranks) > 1 else None, utilization, num_blocks,
                                  block_bytes, min_blocks))
    return num_blocks


def graph_reserve(decode_peak: int, logits_row_bytes: int, buckets: Sequence[int]) -> int:
    """The decode CUDA graphs' memory pool (``pd.engine.cuda_graphs``).

    They are captured largest bucket first into one pool: the largest one's
    forward (``decode_peak``, measured eagerly, its logits included), then
    each smaller one reusing those temporaries, but each keeps its logits of
    ``logits_row_bytes`` a row there for good.
    """
    return decode_peak + logits_row_bytes * (sum(buckets) - max(buckets))


def profile_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """The new tokens of each sequence of the largest step, the one the profile runs (as vLLM's profile run).

    The step's whole token budget spread evenly over as many sequences as a
    step may hold, so its logits have the most rows too; a step can hold no
    more than ``max_num_seqs`` sequences of ``max_model_len`` tokens.
    """
    num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    num_seqs = min(max_num_seqs, num_tokens)
    base, extra = divmod(num_tokens, num_seqs)
    return [base + 1] * extra + [base] * (num_seqs - extra)


def _no_room(memory: DeviceMemory, rank: int | None, utilization: float, num_blocks: int, block_bytes: int,
             min_blocks: int) -> str:
    where = "the device" if rank is None else f"rank {rank}'s device"
    message = (f"gpu_memory_utilization {utilization} of {where} ({_gib(memory.total)}) leaves room for "
               f"{num_blocks} KV blocks of {block_bytes / 1024**2:.1f} MiB, and one request of max_model_len "
               f"tokens needs {min_blocks}: this engine's weights and buffers take {_gib(memory.in_use)}, the "
               f"largest step's activations {_gib(memory.peak_activations)} and the CUDA graphs "
               f"{_gib(memory.graph_reserve)}")
    steps = memory.peak_activations + memory.graph_reserve
    if memory.free - steps < int(memory.total * utilization) - memory.in_use - steps:
        message += f", and only {_gib(memory.free)} of the device is free (other processes hold the rest)"
    return (message + ". Raise gpu_memory_utilization, lower max_model_len (or max_num_batched_tokens, "
            "max_num_seqs, cuda_graph_max_batch), or free the device")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 1024**3:.1f} GiB"
