"""The ingress's rule for where a prompt is prefilled: on the prefill pool, or on its decode replica.

Pure, so the simulator runs it as the ingress does. With ``predicted``, and
once both pools' latency predictions and the transfers have data
(``router.latency``), it compares seconds:

    remote  iff  remote.ttft_s + transfer_s + overhead_s  <  local.ttft_s + stall_weight * stall_s

``remote`` is the prefill pool's best replica (its wait and prefill),
``transfer_s`` the pull of the blocks the decode replica lacks, and
``overhead_s`` the extra calls of the remote path. ``local`` is the decode
pool's best replica for the prompt, and ``stall_s`` the prefill there, which
every decode running beside it waits through: counted when it has any.
Before that data, and without ``predicted``, a threshold decides:

    remote  iff  num_prompt_tokens > threshold
            and  uncached_tokens   > threshold + threshold_per_in_flight * prefill_in_flight
            and  prefill_in_flight < queue_bound

``uncached_tokens`` is what the decode replica would compute itself (the
decode pool's prefix index says how much of the prompt it holds): a prompt
the decode pool already holds is prefilled there even when it is long. A
positive ``threshold_per_in_flight`` raises the bar as the prefill pool
fills, so short prompts stay local when remote prefill would queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from router.latency import LatencyPredictor, Prediction
from router.prefix_index import PrefixIndex


@dataclass(frozen=True)
class RemotePrefillRule:
    threshold: int = 256  # uncached prompt tokens at or below which the decode replica prefills
    queue_bound: int = 32  # prefill calls in flight from this ingress at which the pool counts as saturated
    threshold_per_in_flight: float = 0.0  # tokens added to the threshold per prefill call in flight
    predicted: bool = False  # decide by predicted latency once the predictions have data
    stall_weight: float = 1.0  # cost per second of decodes stalled by a local prefill, in seconds of TTFT

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.queue_bound < 1:
            raise ValueError(f"queue_bound must be >= 1, got {self.queue_bound}")
        if self.threshold_per_in_flight < 0:
            raise ValueError(f"threshold_per_in_flight must be >= 0, got {self.threshold_per_in_flight}")
        if self.stall_weight < 0:
            raise ValueError(f"stall_weight must be >= 0, got {self.stall_weight}")

    def may_go_remote(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt is long enough to consider at all (before looking up what is cached)."""
        return num_prompt_tokens > self.threshold

    def wants_remote(self, num_prompt_tokens: int, uncached_tokens: int, prefill_in_flight: int) -> bool:
        if not self.may_go_remote(num_prompt_tokens) or prefill_in_flight >= self.queue_bound:
            return False
        return uncached_tokens > self.threshold + self.threshold_per_in_flight * prefill_in_flight

    def prefers_remote(self, local: Prediction, remote: Prediction, transfer_s: float, overhead_s: float) -> bool:
        """The predicted comparison (module docstring)."""
        stall_s = local.compute_s if local.num_decoding else 0.0
        return remote.ttft_s + transfer_s + overhead_s < local.ttft_s + self.stall_weight * stall_s


@dataclass
class PoolPredictions:
    """What the ingress knows of one pool for the predicted rule: its predictor, prefix index and replicas."""

    predictor: LatencyPredictor
    index: PrefixIndex
    replica_ids: Sequence[str]

    def best(self, block_hashes: Sequence[bytes], num_prompt_tokens: int, now_s: float) -> Prediction | None:
        runs = self.index.match_tiers(block_hashes, list(self.replica_ids))
        return self.predictor.best(runs, num_prompt_tokens, self.replica_ids, now_s)


def predicted_remote(rule: RemotePrefillRule, decode: PoolPredictions, prefill: PoolPredictions, block_hashes: Sequence[bytes],
                     num_prompt_tokens: int, block_size: int, overhead_s: float, now_s: float) -> bool | None:
    """The predicted rule's answer; None while a prediction or the transfers have no data (the threshold decides)."""
    local = decode.best(block_hashes, num_prompt_tokens, now_s)
    remote = prefill.best(block_hashes, num_prompt_tokens, now_s) if local is not None else None
    if remote is None:
        return None
    blocks = -(-num_prompt_tokens // block_size) - local.matched_tokens // block_size
    transfer_s = decode.predictor.transfer.seconds(blocks)
    if transfer_s is None:
        return None
    return rule.prefers_remote(local, remote, transfer_s, overhead_s)
