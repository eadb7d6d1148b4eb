"""CUDA events around each step's device work, for the benchmarks that time it (``bench.decode_roofline``,
``bench.step_overhead``)."""

from __future__ import annotations

import torch

from pd.workload.stats import percentile


class DeviceTimer:
    """CUDA events from each step's copy of its inputs to the device (``runner.to_device``) to the end of
    the work its launch queued (``runner.launch``): the device's time for the step, and any wait it has
    while the host enqueues that work. Wraps ``runner``'s two methods when built.

    One ``(start, end)`` pair a launch, in ``marks``; the idle gap before a step is from the end of the
    one before to its start:

        | start  step N  end |  gap  | start  step N+1  end |
    """

    def __init__(self, runner):
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None
        to_device, launch = runner.to_device, runner.launch

        def timed_to_device(*args, **kwargs):
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            return to_device(*args, **kwargs)

        def timed_launch(*args, **kwargs):
            launched = launch(*args, **kwargs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((self._start, end))
            return launched

        runner.to_device, runner.launch = timed_to_device, timed_launch

    def take(self) -> float:
        """The milliseconds of the launches since the last call, summed."""
        torch.cuda.synchronize()
        ms = sum(start.elapsed_time(end) for start, end in self.marks)
        self.marks.clear()
        return ms

    def summary(self, first: int) -> tuple[float, float]:
        """Median (busy ms, idle ms before the step) over the steps from ``first`` on."""
        torch.cuda.synchronize()
        marks = self.marks[first:]
        busy = [start.elapsed_time(end) for start, end in marks]
        gaps = [max(0.0, before_end.elapsed_time(start)) for (_, before_end), (start, _) in zip(marks, marks[1:])]
        return percentile(busy, 50), percentile(gaps, 50) if gaps else 0.0
