"""SLO report of one or more load-test runs: ``python -m loadtest.report RUN_DIR``.

Finds every ``*_requests.csv`` (with its ``*_meta.json`` and locust's
``*_stats.csv``) under ``RUN_DIR`` and writes ``RUN_DIR/report.md``,
``RUN_DIR/summary.json`` and PNG plots. Runs with the same label (a server
config in a sweep) form one series over offered load.

Definitions:

- Percentiles are p50/p90/p99, interpolated linearly between ranks
  (``bench.stats``, the one definition the benchmarks use too). TTFT and ITL
  count every request that did not fail, so that the slowest do not drop out
  under overload: a request cut off by the end of the run adds its gaps, and
  its TTFT, or if it had no first token yet its wait so far (then the TTFT
  percentiles are lower bounds). TPOT and E2E are over successful requests.
- A request meets the SLO if it succeeded, its TTFT is within the TTFT SLO and
  its TPOT within the per-token SLO. Attainment is the fraction that meet it
  of the answered requests (successes and failures) plus the requests cut off
  by the end of the run that had already lost the SLO: no first token yet
  after the TTFT SLO, a late first token, or too long in decode for even
  ``max_tokens`` to bring the TPOT within the SLO. Other cut-off requests are
  left out; under overload this keeps the queue that piles up at the end from
  looking like success.
- Goodput is requests per second that meet the SLO. A series' operating point
  is its highest offered load whose attainment is at least 90%; the goodput
  there is the series' goodput.
- Offered load is the arrival rate of an open-loop run; for closed-loop users
  it is the rate at which requests were sent.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.stats import percentiles
from loadtest.records import META_SUFFIX, REQUESTS_SUFFIX, STATS_SUFFIX, RequestRecord, RunMeta, Status, read_requests

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


def locust_stats(prefix: Path) -> dict[str, tuple[int, int]]:
    """``request_type -> (requests, failures)`` from locust's ``*_stats.csv``, summed over names."""
    path = Path(str(prefix) + STATS_SUFFIX)
    totals: dict[str, tuple[int, int]] = {}
    if not path.exists():
        return totals
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            kind = row.get("Type") or ""
            if not kind:  # the "Aggregated" row
                continue
            count, failures = totals.get(kind, (0, 0))
            totals[kind] = (count + int(row["Request Count"]), failures + int(row["Failure Count"]))
    return totals


def _ms(value: float) -> str:
    if math.isnan(value):
        return "–"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _pct(value: float) -> str:
    return "–" if math.isnan(value) else f"{100 * value:.0f}%"


def render_markdown(run_dir: Path, runs: list[RunData], plots: list[str]) -> str:
    summaries = [run.summary for run in runs]
    slos = sorted({(s.slo_ttft_ms, s.slo_tpot_ms) for s in summaries})
    lines = ["# Load test report", ""]
    lines.append(f"{len(runs)} run(s) under `{run_dir}`. SLO: "
                 + "; ".join(f"TTFT ≤ {ttft:g} ms and TPOT ≤ {tpot:g} ms" for ttft, tpot in slos)
                 + ". Goodput counts requests per second that meet both; a series' operating point is its "
                   f"highest offered load with SLO attainment ≥ {ATTAINMENT_TARGET:.0%}.")
    lines += ["", "## Goodput", "", "| series | operating point (offered req/s) | goodput (req/s) | attainment |",
              "|---|---|---|---|"]
    for label, point in operating_points(summaries).items():
        if point is None:
            lines.append(f"| {label} | none: attainment < {ATTAINMENT_TARGET:.0%} at every load | 0 | |")
        else:
            lines.append(f"| {label} | {point.offered_rps:.2f} | {point.goodput_rps:.2f} | {_pct(point.attainment)} |")
    lines += ["", "## Load and SLO", "",
              "| series | workload | offered req/s | sent req/s | seconds | ok | failed | cut off (SLO lost) "
              "| output tok/s | attainment | goodput req/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        offered = f"{s.offered_rps:.2f}" + ("" if s.open_loop else " (closed loop)")
        lines.append(f"| {s.label} | {s.workload} | {offered} | {s.sent_rps:.2f} | {s.duration_s:.0f} | {s.num_ok} "
                     f"| {s.num_failed} | {s.num_cutoff} ({s.num_cutoff_lost}) | {s.output_tokens_per_s:.0f} "
                     f"| {_pct(s.attainment)} | {s.goodput_rps:.2f} |")
    lines += ["", "## Latency (ms)", "", "TTFT and ITL include requests cut off by the end of a run (a cut-off "
              "request's wait for a first token is a lower bound of its TTFT); TPOT and E2E are over "
              "successful requests.", "",
              "| series | offered req/s | TTFT p50 | p90 | p99 | ITL p50 | p90 | p99 | TPOT p50 | p90 | p99 "
              "| E2E p50 | p90 | p99 |", "|---|---|" + "---|" * 12]
    for s in summaries:
        cells = [_ms(v) for p in (s.ttft_ms, s.itl_ms, s.tpot_ms, s.e2e_ms) for v in (p.p50, p.p90, p.p99)]
        lines.append(f"| {s.label} | {s.offered_rps:.2f} | " + " | ".join(cells) + " |")
    errors = Counter(r.error for run in runs for r in run.records if r.status == Status.FAILED)
    if errors:
        lines += ["", "## Failures", "", "| count | error |", "|---|---|"]
        lines += [f"| {count} | {error.replace('|', '/')[:160]} |" for error, count in errors.most_common(10)]
    lines += ["", "## Locust's counts (`*_stats.csv`)", "",
              "| run | TTFT | ITL | TPOT | E2E | E2E failures |", "|---|---|---|---|---|---|"]
    for run in runs:
        stats = locust_stats(run.prefix)
        counts = [str(stats.get(kind, (0, 0))[0]) for kind in ("TTFT", "ITL", "TPOT", "E2E")]
        lines.append(f"| {run.summary.name} | " + " | ".join(counts) + f" | {stats.get('E2E', (0, 0))[1]} |")
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> Path:
    """Write ``report.md``, ``summary.json`` and the plots into ``run_dir``; the path of ``report.md``."""
    from loadtest.plots import write_plots

    run_dir = Path(run_dir)
    runs = load_runs(run_dir, slo_ttft_ms, slo_tpot_ms)
    if not runs:
        raise FileNotFoundError(f"no *{REQUESTS_SUFFIX} under {run_dir}; run locust with --csv {run_dir}/NAME")
    plots = write_plots(run_dir, runs)
    report = run_dir / "report.md"
    report.write_text(render_markdown(run_dir, runs, plots))
    summaries = [run.summary for run in runs]
    points = {label: (p.name if p else None) for label, p in operating_points(summaries).items()}
    summary = {"runs": [asdict(s) for s in summaries], "operating_points": points}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")  # NaN where unknown
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="directory holding the runs' CSVs (searched recursively)")
    parser.add_argument("--slo-ttft-ms", type=float, help="override the runs' TTFT SLO")
    parser.add_argument("--slo-tpot-ms", type=float, help="override the runs' per-token SLO")
    args = parser.parse_args(argv)
    print(write_report(args.run_dir, args.slo_ttft_ms, args.slo_tpot_ms))


if __name__ == "__main__":
    main()
