"""The router matrix's TTFT p99 by load, one panel per trace, from ``bench.router_matrix``'s JSON lines.

``python -m bench.router_matrix_plot MATRIX.jsonl [MORE.jsonl ...] --out router-matrix.png``

Each panel is one trace: the seed-median TTFT p99 of every policy at each
load (a fraction of the pool's capacity under the prefix-affinity router), on a log
scale, with the seeds' min-max as a band. Matplotlib is imported here only.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read_summaries(paths: list[Path]) -> dict[str, dict[str, list[tuple[float, dict]]]]:
    """trace -> policy -> [(load, ttft_p99_s spread)], in load order."""
    out: dict[str, dict[str, list[tuple[float, dict]]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "policy" in record and "load" in record:
                out[record["trace"]][record["policy"]].append((record["load"], record["ttft_p99_s"]))
    for policies in out.values():
        for points in policies.values():
            points.sort(key=lambda point: point[0])
    return out


def plot(summaries: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(summaries)
    columns = min(3, len(traces))
    rows = -(-len(traces) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    for position, trace in enumerate(traces):
        axis = axes[position // columns][position % columns]
        for policy, points in sorted(summaries[trace].items()):
            loads = [load for load, _ in points]
            axis.plot(loads, [spread["median"] for _, spread in points], marker="o", label=policy)
            axis.fill_between(loads, [spread["min"] for _, spread in points],
                              [spread["max"] for _, spread in points], alpha=0.12)
        axis.set_title(trace)
        axis.set_yscale("log")
        axis.set_xlabel("load (fraction of capacity)")
        axis.set_ylabel("TTFT p99 (s), seed median")
        axis.grid(True, which="both", alpha=0.3)
    for position in range(len(traces), rows * columns):
        axes[position // columns][position % columns].axis("off")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.router_matrix_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    plot(read_summaries(args.inputs), args.out)


if __name__ == "__main__":
    main()
