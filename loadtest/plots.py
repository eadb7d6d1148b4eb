"""The report's PNGs (matplotlib, no display needed).

- ``latency_cdf.png``: CDFs of TTFT, inter-token latency and E2E (samples as
  in the report's percentiles), one line per run; a series keeps its colour,
  and higher loads are drawn darker.
- ``latency_vs_load.png``: TTFT p90 and inter-token p90 against offered load,
  one line per series, with the SLOs.
- ``goodput_vs_load.png``: goodput and SLO attainment against offered load.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
import numpy as np  # noqa: E402

from pd.workload.records import Status  # noqa: E402
from pd.workload.summary import ATTAINMENT_TARGET, RunData, itl_samples, operating_points, ttft_samples  # noqa: E402

DPI = 90


def write_plots(run_dir: Path, runs: list[RunData]) -> list[str]:
    """Write the PNGs into ``run_dir``; their file names."""
    colours = _colours(runs)
    names = []
    for name, draw in (("latency_cdf.png", _latency_cdf), ("latency_vs_load.png", _latency_vs_load),
                       ("goodput_vs_load.png", _goodput_vs_load)):
        fig = draw(runs, colours)
        fig.savefig(run_dir / name, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _plain_log_labels(axis) -> None:
    """Log-axis ticks as plain numbers; the 2s and 5s between decades too, when few decades show."""

    def minor(value: float, _position) -> str:
        low, high = sorted(axis.get_view_interval())
        few_decades = low > 0 and high / low <= 1e3
        return f"{value:g}" if few_decades and f"{value:e}"[0] in "25" else ""

    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _position: f"{value:g}"))
    axis.set_minor_formatter(matplotlib.ticker.FuncFormatter(minor))


def _colours(runs: list[RunData]) -> dict[str, str]:
    labels = list(dict.fromkeys(run.summary.label for run in runs))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {label: cycle[i % len(cycle)] for i, label in enumerate(labels)}


def _series(runs: list[RunData]) -> dict[str, list[RunData]]:
    series: dict[str, list[RunData]] = {}
    for run in runs:
        series.setdefault(run.summary.label, []).append(run)
    for members in series.values():
        members.sort(key=lambda run: run.summary.offered_rps)
    return series


def _latency_cdf(runs: list[RunData], colours: dict[str, str]):
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("TTFT", ttft_samples), ("inter-token latency", itl_samples),
              ("end-to-end latency (successful requests)", lambda records: [r.e2e_ms for r in records
                                                                            if r.status == Status.OK]))
    for ax, (title, samples) in zip(axes, panels):
        for label, members in _series(runs).items():
            for rank, run in enumerate(members):
                values = np.sort([v for v in samples(run.records) if not math.isnan(v) and v > 0])
                if values.size == 0:
                    continue
                shade = 0.35 + 0.65 * (rank + 1) / len(members)
                ax.plot(values, np.arange(1, values.size + 1) / values.size, color=colours[label], alpha=shade,
                        label=f"{label} @ {run.summary.offered_rps:.2f} req/s")
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    fig.suptitle("Latency CDFs (TTFT and ITL include requests cut off at the end)")
    fig.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:  # under the axes; savefig's tight bounding box takes it in
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=8,
                   bbox_to_anchor=(0.5, 0.0))
    return fig


def _latency_vs_load(runs: list[RunData], colours: dict[str, str]):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    slo = runs[0].summary
    for label, members in _series(runs).items():
        x = [run.summary.offered_rps for run in members]
        axes[0].plot(x, [run.summary.ttft_ms.p90 for run in members], "o-", color=colours[label], label=label)
        axes[1].plot(x, [run.summary.itl_ms.p90 for run in members], "o-", color=colours[label], label=label)
    axes[0].axhline(slo.slo_ttft_ms, color="grey", ls="--", lw=1, label=f"TTFT SLO {slo.slo_ttft_ms:g} ms")
    axes[1].axhline(slo.slo_tpot_ms, color="grey", ls="--", lw=1, label=f"per-token SLO {slo.slo_tpot_ms:g} ms")
    for ax, title in zip(axes, ("TTFT p90 (ms)", "inter-token latency p90 (ms)")):
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(title)
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Tail latency against offered load")
    return fig


def _goodput_vs_load(runs: list[RunData], colours: dict[str, str]):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    points = operating_points([run.summary for run in runs])
    top = max(run.summary.offered_rps for run in runs)
    axes[0].plot([0, top], [0, top], color="grey", ls=":", lw=1, label="goodput = offered")
    for label, members in _series(runs).items():
        x = [run.summary.offered_rps for run in members]
        axes[0].plot(x, [run.summary.goodput_rps for run in members], "o-", color=colours[label], label=label)
        axes[1].plot(x, [100 * run.summary.attainment for run in members], "o-", color=colours[label], label=label)
        point = points.get(label)
        if point is not None:
            axes[0].plot([point.offered_rps], [point.goodput_rps], "*", ms=14, color=colours[label])
    axes[1].axhline(100 * ATTAINMENT_TARGET, color="grey", ls="--", lw=1, label=f"{ATTAINMENT_TARGET:.0%} target")
    axes[0].set_ylabel("goodput (req/s meeting the SLO)")
    axes[1].set_ylabel("SLO attainment (%)")
    axes[1].set_ylim(0, 105)
    for ax in axes:
        ax.set_xlabel("offered load (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Goodput (★ operating point: highest load with attainment ≥ 90%)")
    return fig
