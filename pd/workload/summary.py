"""A load-test run's numbers: percentiles, SLO attainment, goodput and operating points.

Pure: records in, summaries out (``load_runs`` only reads the run's files).
``loadtest.report`` renders these as markdown and plots; the simulator's
replay summarizes its simulated requests with the same ``summarize`` so the
two are compared number for number. The definitions (what counts toward TTFT,
attainment and goodput) are stated in ``loadtest.report``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pd.workload.records import META_SUFFIX, REQUESTS_SUFFIX, RequestRecord, RunMeta, Status, read_requests
from pd.workload.stats import percentiles

ATTAINMENT_TARGET = 0.9
DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_TPOT_MS = 100.0


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Percentiles":
        finite = [v for v in values if not math.isnan(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan)
        return cls(*percentiles(finite, [50, 90, 99]))


@dataclass(frozen=True)
class RunSummary:
    label: str
    name: str  # the run's CSV prefix, relative to the report directory
    workload: str
    open_loop: bool
    offered_rps: float
    sent_rps: float
    duration_s: float
    num_ok: int
    num_failed: int
    num_cutoff: int
    num_cutoff_lost: int  # cut off with the SLO already lost; they count against attainment
    output_tokens_per_s: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    slo_ttft_ms: float
    slo_tpot_ms: float
    attainment: float
    goodput_rps: float


@dataclass(frozen=True)
class RunData:
    prefix: Path
    meta: RunMeta | None
    records: list[RequestRecord]
    summary: RunSummary

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.status == Status.OK]


def ttft_samples(records: list[RequestRecord]) -> list[float]:
    """TTFTs of the requests that did not fail; a cut-off one without a first token counts its wait so far."""
    return [r.e2e_ms if r.status == Status.CUTOFF and math.isnan(r.ttft_ms) else r.ttft_ms
            for r in records if r.status != Status.FAILED]


def itl_samples(records: list[RequestRecord]) -> list[float]:
    """Every inter-token gap of the requests that did not fail."""
    return [gap for r in records if r.status != Status.FAILED for gap in r.itl_ms]


def meets_slo(record: RequestRecord, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    return (
        record.status == Status.OK
        and record.ttft_ms <= slo_ttft_ms
        and (math.isnan(record.tpot_ms) or record.tpot_ms <= slo_tpot_ms)
    )


def lost_before_cutoff(record: RequestRecord, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """A request cut off by the end of the run whose SLO was already lost, whatever came next.

    Its TTFT is at least its wait so far, and its TPOT at least the decode
    time so far over ``max_tokens - 1``: it could end no sooner, nor with more tokens.
    """
    if record.status != Status.CUTOFF:
        return False
    if math.isnan(record.ttft_ms):
        return record.e2e_ms > slo_ttft_ms
    if record.ttft_ms > slo_ttft_ms:
        return True
    return record.max_tokens > 1 and (record.e2e_ms - record.ttft_ms) / (record.max_tokens - 1) > slo_tpot_ms


def summarize(name: str, records: list[RequestRecord], meta: RunMeta | None,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> RunSummary:
    """One run's numbers; SLOs default to the ones the run was made with."""
    slo_ttft = slo_ttft_ms or (meta.slo_ttft_ms if meta else DEFAULT_SLO_TTFT_MS)
    slo_tpot = slo_tpot_ms or (meta.slo_tpot_ms if meta else DEFAULT_SLO_TPOT_MS)
    ok = [r for r in records if r.status == Status.OK]
    answered = [r for r in records if r.status != Status.CUTOFF]
    lost = [r for r in records if lost_before_cutoff(r, slo_ttft, slo_tpot)]
    duration = _duration(records, meta)
    open_loop = bool(meta and meta.arrival_rate)
    offered = meta.arrival_rate if open_loop else len(records) / duration
    num_good = sum(meets_slo(r, slo_ttft, slo_tpot) for r in answered)
    return RunSummary(
        label=meta.label if meta and meta.label else name,
        name=name,
        workload=meta.workload if meta else "",
        open_loop=open_loop,
        offered_rps=offered,
        sent_rps=len(records) / duration,
        duration_s=duration,
        num_ok=len(ok),
        num_failed=len(answered) - len(ok),
        num_cutoff=len(records) - len(answered),
        num_cutoff_lost=len(lost),
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
        ttft_ms=Percentiles.of(ttft_samples(records)),
        itl_ms=Percentiles.of(itl_samples(records)),
        tpot_ms=Percentiles.of([r.tpot_ms for r in ok]),
        e2e_ms=Percentiles.of([r.e2e_ms for r in ok]),
        slo_ttft_ms=slo_ttft,
        slo_tpot_ms=slo_tpot,
        attainment=num_good / (len(answered) + len(lost)) if answered or lost else math.nan,
        goodput_rps=num_good / duration,
    )


def _duration(records: list[RequestRecord], meta: RunMeta | None) -> float:
    if meta and meta.end_time > meta.start_time:
        return meta.end_time - meta.start_time
    if not records:
        return math.nan
    ends = [r.start_time + (0 if math.isnan(r.e2e_ms) else r.e2e_ms / 1000) for r in records]
    return max(max(ends) - min(r.start_time for r in records), 1e-9)


def load_runs(run_dir: Path, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> list[RunData]:
    runs = []
    for path in sorted(run_dir.rglob("*" + REQUESTS_SUFFIX)):
        prefix = Path(str(path)[: -len(REQUESTS_SUFFIX)])
        meta_path = Path(str(prefix) + META_SUFFIX)
        meta = RunMeta.read(meta_path) if meta_path.exists() else None
        records = read_requests(path)
        name = str(prefix.relative_to(run_dir))
        runs.append(RunData(prefix, meta, records, summarize(name, records, meta, slo_ttft_ms, slo_tpot_ms)))
    runs.sort(key=lambda run: (run.summary.label, run.summary.offered_rps))
    return runs


def operating_points(summaries: list[RunSummary]) -> dict[str, RunSummary | None]:
    """Per series, the run at the highest offered load with attainment >= 90% (None: no such run)."""
    points: dict[str, RunSummary | None] = {}
    for summary in summaries:
        points.setdefault(summary.label, None)
        if summary.attainment >= ATTAINMENT_TARGET:
            best = points[summary.label]
            if best is None or summary.offered_rps > best.offered_rps:
                points[summary.label] = summary
    return points
