"""CUDA events around each step's device work, for the benchmarks that time it (``bench.decode_roofline``,
``bench.step_overhead``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from pd.engine import model_runner
from pd.workload.stats import percentile


class DeviceTimer:
    """CUDA events from each step's copy of its inputs to the device (``pd.engine.model_runner.to_device``,
    as ``runner.launch`` calls it) to the end of the work its launch queued: the device's time for the step,
    and any wait it has while the host enqueues that work. Wraps ``runner.launch`` and that function (for
    this runner's launches only) when built; ``close`` unwraps them.

    One ``(start, end)`` pair a launch, in ``marks``; the idle gap before a step is from the end of the
    one before to its start:

        | start  step N  end |  gap  | start  step N+1  end |

    ``event`` and ``synchronize`` are CUDA's unless given (a test's clock on the CPU).
    """

    def __init__(self, runner, event: Callable[[], Any] | None = None, synchronize: Callable[[], None] | None = None):
        self.marks: list[tuple[Any, Any]] = []
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._synchronize = synchronize or torch.cuda.synchronize
        self._start: Any = None
        self._launching = False
        self._runner, self._to_device = runner, model_runner.to_device
        launch, to_device = runner.launch, model_runner.to_device

        def timed_to_device(*args, **kwargs):
            if self._launching:
                self._start = self._event()
                self._start.record()
            return to_device(*args, **kwargs)

        def timed_launch(*args, **kwargs):
            self._launching, self._start = True, None
            try:
                launched = launch(*args, **kwargs)
            finally:
                self._launching = False
            if self._start is None:
                raise RuntimeError("runner.launch copied no inputs through model_runner.to_device: the timer's "
                                   "seam moved")
            end = self._event()
            end.record()
            self.marks.append((self._start, end))
            return launched

        model_runner.to_device, runner.launch = timed_to_device, timed_launch

    def close(self) -> None:
        """Unwrap the runner's launch and the copy function."""
        model_runner.to_device = self._to_device
        del self._runner.launch

    def take(self) -> float:
        """The milliseconds of the launches since the last call, summed."""
        self._synchronize()
        ms = sum(start.elapsed_time(end) for start, end in self.marks)
        self.marks.clear()
        return ms

    def summary(self, first: int) -> tuple[float, float]:
        """Median (busy ms, idle ms before the step) over the steps from ``first`` on."""
        self._synchronize()
        marks = self.marks[first:]
        busy = [start.elapsed_time(end) for start, end in marks]
        gaps = [max(0.0, before_end.elapsed_time(start)) for (_, before_end), (start, _) in zip(marks, marks[1:])]
        return percentile(busy, 50), percentile(gaps, 50) if gaps else 0.0
