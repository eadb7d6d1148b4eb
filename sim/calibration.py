"""What a quiet machine's profile does not see of the served app, fitted from one served run.

``calibrate`` fits a ``Calibration`` to a run the app served (``sim.replay``);
``calibrated_spec`` is the app's simulated deployment with it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from pd.workload.records import RequestRecord, Status
from sim.cluster import ClusterSpec
from sim.cost import CostModel
from sim.host import HostModel
from sim.replay import Run, simulate_runs
from sim.transport import LINKS


@dataclass(frozen=True)
class Calibration:
    """What the profile does not see of the served app.

    Its replicas spend ``step_s`` more on each step and ``token_s`` on each
    token a step samples, serially with their steps: the replica's event
    loop takes each step's outputs and streams every token through Ray,
    sharing the process (and its GIL) with the step thread. Its engines share
    the machine's cores with the HTTP proxy, the ingress and the load
    generator, which spend ``cpu_per_token_s`` on each streamed token
    (``sim.host``); the ingress spends ``ingress_s`` on a request before
    it places it (parsing, chat template, tokens, hashes), on those same
    cores, so it stretches with the load on them; and each token
    reaches the client after a delay of mean ``jitter_s`` on its way through
    the ingress, the proxy and the client, which share two busy cores: it
    spreads the gaps between tokens (and delivers some together) without
    slowing the engine.
    """

    step_s: float = 0.0
    token_s: float = 0.0
    ingress_s: float = 0.0
    cpu_per_token_s: float = 0.0
    jitter_s: float = 0.0


# What the proxy, the ingress and the client spend on a streamed token, measured from /proc on one stream on
# this class of 2-core host: ingress 1.5-2.2 ms, proxy 0.9-1.3 ms, locust the rest.
DEFAULT_CPU_PER_TOKEN_S = 0.004
# A number of concurrent streams enters the ITL line with at least this many gaps measured at it.
MIN_GAPS_PER_STREAM_COUNT = 50


def itl_by_streams(records: Sequence[RequestRecord]) -> dict[int, float]:
    """The median gap between two tokens (ms) for each number of streams that were decoding when it ended.

    A stream decodes from its first token to its last; the count is the
    client's view, from the records alone, so the measured and the
    simulated runs are counted alike.
    """
    done = [r for r in records if r.status == Status.OK and r.itl_ms]
    if not done:
        return {}
    first = np.sort([r.start_time + r.ttft_ms / 1000 for r in done])
    last = np.sort([r.start_time + r.e2e_ms / 1000 for r in done])
    times, gaps = [], []
    for record in done:
        ends = record.start_time + (record.ttft_ms + np.cumsum(record.itl_ms)) / 1000
        times.append(ends)
        gaps.append(np.asarray(record.itl_ms))
    times, gaps = np.concatenate(times), np.concatenate(gaps)
    streams = np.searchsorted(first, times, side="right") - np.searchsorted(last, times, side="left")
    return {int(n): float(np.median(gaps[streams == n])) for n in np.unique(streams)
            if n > 0 and (streams == n).sum() >= MIN_GAPS_PER_STREAM_COUNT}


@dataclass(frozen=True)
class ItlLine:
    """``itl_by_streams`` as ``intercept_ms + slope_ms * streams`` (least squares; no slope from one point),
    from ``first`` streams up."""

    intercept_ms: float
    slope_ms: float | None
    first: int

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> ItlLine | None:
        points = itl_by_streams(records)
        if not points:
            return None
        if len(points) == 1:
            (count, gap), = points.items()
            return cls(gap, None, count)
        slope, intercept = np.polyfit(list(points), list(points.values()), 1)
        return cls(float(intercept), float(slope), min(points))

    def at(self, streams: int) -> float:
        return self.intercept_ms + (self.slope_ms or 0.0) * streams


def calibrate(runs: Sequence[Run], spec_for: Callable[[Calibration], ClusterSpec], iterations: int = 4,
              before: Sequence[Run] = (), cpu_per_token_s: float = DEFAULT_CPU_PER_TOKEN_S) -> Calibration:
    """The calibration that makes the runs' gaps between tokens, and the first run's spread and TTFT p50, match.

    The replicas' overheads are fitted to the median gap between tokens at
    each number of streams decoding (``ItlLine``), the ingress time to TTFT
    p50 and the delivery's jitter to the gaps' spread (p90 less p50). The
    rest of the path's CPU per token is given, not fitted: one run at a light
    load cannot tell it from the jitter (an earlier calibration searched a
    grid of it for the closest ITL p90; with the jitter fitted, every value
    of the grid matched, and the choice was noise). From runs at rates
    that are not validated, served one after the other, the lightest first:
    the gaps' line is fitted to all of them together (a light run has one to
    three streams decoding; a heavier one shows how the gaps grow past
    them), the ingress time and the jitter to the first. ``before`` are the
    runs the app served before them, replayed first as the comparison
    replays them: their prompts warm the simulated caches as they warmed the
    real ones.
    """
    measured = runs[0].summary()
    line = ItlLine.of([record for run in runs for record in run.records])
    calibration = Calibration(cpu_per_token_s=cpu_per_token_s)
    for _ in range(iterations):
        replayed = simulate_runs([*before, *runs], spec_for(calibration), calibration.jitter_s)[0][len(before):]
        simulated = runs[0].summary(replayed[0])
        sim_line = ItlLine.of([record for records in replayed for record in records])
        step_s, token_s = calibration.step_s, calibration.token_s
        if line is not None and sim_line is not None:
            if line.slope_ms is not None and sim_line.slope_ms is not None:
                token_s = max(0.0, token_s + (line.slope_ms - sim_line.slope_ms) / 1000)
            # a step of n streams samples n tokens: the step's overhead takes what the tokens' does not
            missed_s = (line.at(line.first) - sim_line.at(line.first)) / 1000
            step_s = max(0.0, step_s + missed_s - line.first * (token_s - calibration.token_s))
        ingress_s = max(0.0, calibration.ingress_s + (measured.ttft_ms.p50 - simulated.ttft_ms.p50) / 1000)
        # the spread of the gaps, p90 over p50, is the delivery's: a difference of two exponential delays
        # of mean m has its p90 1.6 m past its median
        spread_missed_ms = ((measured.itl_ms.p90 - measured.itl_ms.p50) - (simulated.itl_ms.p90 - simulated.itl_ms.p50))
        jitter_s = max(0.0, calibration.jitter_s + spread_missed_ms / 1.6 / 1000)
        calibration = Calibration(step_s, token_s, ingress_s, cpu_per_token_s, jitter_s)
    return calibration


def calibrated_spec(args: dict, cost_for_threads: Callable[[int], CostModel], calibration: Calibration,
                    call_s: float, why: str = "served") -> ClusterSpec:
    """The app of ``args`` as served on this machine: its steps' overheads added, its ingress timed, its host's
    cores shared."""
    from sim.deployment import cluster_spec

    def cost(threads: int) -> CostModel:
        measured = cost_for_threads(threads)
        if not calibration.step_s and not calibration.token_s:
            return measured
        return measured.with_overhead(calibration.step_s, calibration.token_s, why)

    spec = cluster_spec(args, cost, LINKS["loopback"], call_s=call_s)
    host = HostModel(os.cpu_count() or 1, calibration.cpu_per_token_s) if calibration.cpu_per_token_s else None
    return dataclasses.replace(spec, ingress_s=calibration.ingress_s, host=host)
