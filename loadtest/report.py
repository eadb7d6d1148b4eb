"""SLO report of one or more load-test runs: ``python -m loadtest.report RUN_DIR``.

Finds every ``*_requests.csv`` (with its ``*_meta.json`` and locust's
``*_stats.csv``) under ``RUN_DIR`` and writes ``RUN_DIR/report.md``,
``RUN_DIR/summary.json`` and PNG plots. Runs with the same label (a server
config in a sweep) form one series over offered load.

Definitions:

- Percentiles are p50/p90/p99, interpolated linearly between ranks
  (``pd.workload.stats``, the one definition the benchmarks use too). TTFT and ITL
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
from dataclasses import asdict
from pathlib import Path

from pd.workload.records import REQUESTS_SUFFIX, STATS_SUFFIX, Status
from pd.workload.summary import ATTAINMENT_TARGET, RunData, load_runs, operating_points


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
