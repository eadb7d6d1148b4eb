"""Tokens per expert per MoE layer over a sliding window of steps: what EPLB places by.

Each step adds its routing (``topk_ids`` per MoE layer) with one ``bincount``
per layer on the device, read back never: the window is a ring of
``num_buckets`` partial sums, each covering ``window_steps / num_buckets``
steps, so the memory is ``num_buckets`` tables whatever the window, and the
oldest bucket is dropped whole as the window slides (the window holds between
``window_steps - bucket`` and ``window_steps`` steps).
"""

from __future__ import annotations

import torch


class ExpertLoad:
    def __init__(self, num_layers: int, num_experts: int, window_steps: int = 1024, num_buckets: int = 8,
                 device: torch.device | str = "cpu"):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"need num_layers >= 1 and num_experts >= 1, got {num_layers} and {num_experts}")
        if num_buckets < 1 or window_steps < num_buckets or window_steps % num_buckets:
            raise ValueError(f"window_steps ({window_steps}) must be a positive multiple of num_buckets "
                             f"({num_buckets})")
        self.num_experts = num_experts
        self.bucket_steps = window_steps // num_buckets
        self._buckets = torch.zeros(num_buckets, num_layers, num_experts, dtype=torch.int64, device=device)
        self._current = 0  # the bucket this step adds to
        self._steps_in_current = 0
        self.num_steps = 0

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one MoE layer's routing of this step (``topk_ids [T, k]``)."""
        self._buckets[self._current, layer].add_(torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts))

    def end_step(self) -> None:
        """Close the step; every ``bucket_steps`` steps the oldest bucket is cleared for the next ones."""
        self.num_steps += 1
        self._steps_in_current += 1
        if self._steps_in_current == self.bucket_steps:
            self._current = (self._current + 1) % self._buckets.shape[0]
            self._buckets[self._current].zero_()
            self._steps_in_current = 0

    def counts(self) -> torch.Tensor:
        """Tokens routed to each expert over the window: ``[num_layers, num_experts]`` int64."""
        return self._buckets.sum(dim=0)
