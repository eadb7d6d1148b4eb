"""``python -m sim.flow --plot PATH``: two panels of what flow control does, from the simulator's replays.

Left, the overload run at 2x capacity: the interactive band's TTFT p99 over
time, in windows of ``WINDOW_S`` by arrival, with flow control, with it but
nothing shed, and without it, against the deadline. Right, the quota run:
each tenant's served tokens per second (prompt and output, counted at the
first token) over time, against ``c``'s quota and the moment ``a`` and ``b``
return.
"""

from __future__ import annotations

import math
from pathlib import Path

from pd.workload.stats import percentile
from sim.flow_trace import FlowRun

WINDOW_S = 5.0  # the left panel's windows, by arrival
BIN_S = 2.0  # the right panel's bins, by first token
RUN_LABELS = {"flow_control": "flow control", "no_shed": "flow control, nothing shed",
              "no_flow_control": "no flow control"}


def interactive_ttft_p99(run: FlowRun, window_s: float = WINDOW_S) -> list[tuple[float, float]]:
    """``(window middle, TTFT p99)`` of the interactive requests served, by arrival window; a window whose
    requests all went unserved is left out (a shed has no TTFT)."""
    ttfts: dict[int, list[float]] = {}
    for arrival in run.arrivals:
        record = run.records[arrival.request_id]
        if arrival.interactive and record.token_times_s:
            ttfts.setdefault(int(arrival.time_s // window_s), []).append(record.ttft_s)
    return [((index + 0.5) * window_s, percentile(sorted(values), 99)) for index, values in sorted(ttfts.items())]


def served_tokens_per_s(run: FlowRun, tenant: str, bin_s: float = BIN_S) -> list[tuple[float, float]]:
    """``(bin middle, tokens per second)``: the prompt and output tokens of ``tenant``'s requests whose first
    token came in each bin."""
    bins = [0.0] * max(1, math.ceil(run.end_s / bin_s))
    for arrival in run.arrivals:
        record = run.records[arrival.request_id]
        if arrival.tenant == tenant and record.token_times_s:
            index = min(len(bins) - 1, int(record.token_times_s[0] // bin_s))
            bins[index] += len(arrival.prompt) + len(record.token_times_s)
    return [((index + 0.5) * bin_s, tokens / bin_s) for index, tokens in enumerate(bins)]


def plot(overload_runs: dict[str, FlowRun], quota_run: FlowRun, quota_tokens_per_s: float, return_s: float,
         deadline_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11.0, 3.8))
    for name, label in RUN_LABELS.items():
        if name in overload_runs:
            points = interactive_ttft_p99(overload_runs[name])
            left.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=label)
    left.axhline(deadline_s, color="black", linestyle="--", linewidth=1, label="deadline")
    left.set_yscale("log")
    left.set_title("2x capacity: interactive TTFT p99")
    left.set_xlabel(f"arrival (s), {WINDOW_S:g} s windows")
    left.set_ylabel("TTFT p99 (s)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    for tenant in sorted({arrival.tenant for arrival in quota_run.arrivals}):
        points = served_tokens_per_s(quota_run, tenant)
        right.plot([x for x, _ in points], [y for _, y in points], label=f"tenant {tenant}")
    right.axhline(quota_tokens_per_s, color="black", linestyle="--", linewidth=1, label="c's quota")
    right.axvline(return_s, color="grey", linestyle=":", linewidth=1, label="a and b return")
    right.set_title("c over its quota, then a and b return")
    right.set_xlabel(f"first token (s), {BIN_S:g} s bins")
    right.set_ylabel("served tokens/s")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
