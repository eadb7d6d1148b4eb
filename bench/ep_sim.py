"""The simulator's expert-parallel step held against the real engine at EP 1 and EP 2 on this CPU.

``python -m bench.ep_sim [--model M] [--threads 1]``

1. Measures the engine at EP 1 on ``--threads`` threads over a grid of batch
   shapes (``sim.profile``), and fits the step cost model; its median relative
   error over its own steps is the simulator's stated error for a step.
2. Measures loopback gloo between two ranks (one all-to-all's bandwidth each
   way, and a small collective's time): the link the ranks share here; and
   what two ranks compute side by side (``bench.ep.host_concurrency``): on a
   host whose two CPUs share one core's units, each rank computes slower
   while the other does.
3. Measures the engine at EP 2 on the same grid, ``--threads`` a rank.
4. Predicts every EP 2 step from the EP 1 fit (``sim.ep_predict``: the
   expert part halved, each rank's compute slowed as step 2 measured, the
   collectives added) and prints the median relative error of the
   predictions, with and without the host's slowdown, and of EP 1's fit taken
   as EP 2's (no EP model), against the stated error.

A tool, not the simulator: it runs the real engine and ``bench``'s host
measure. The default model is ``bench.engine``'s ``moe`` (a Qwen3-MoE of 16 experts, 4
a token, random weights, so routing is near uniform). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.engine import make_checkpoint
from bench.ep import host_concurrency
from pd.model.config import load_model_config
from pd.workload.host import cpu_flags, cpu_name
from sim.cost import CostModel
from sim.ep_predict import predict_expert_parallel
from sim.profile import measure, median_relative_error

BATCH_SIZES = (1, 4, 16)
PROMPT_LENS = (32, 256)


def loopback_link(num_bytes: int = 8 << 20, repeats: int = 5) -> tuple[float, float]:
    """``(bytes/s each way, seconds a small collective)`` of gloo between two ranks on this machine."""
    from pd.engine.tp.group import TPGroup

    cpu = torch.device("cpu")
    groups = [TPGroup(0, 2, "127.0.0.1", 0, cpu, 30.0)]
    groups.append(TPGroup(1, 2, "127.0.0.1", groups[0].port, cpu, 30.0))
    results: list[tuple[float, float]] = [(0.0, 0.0)] * 2

    def rank(r: int) -> None:
        group = groups[r]
        group.connect()
        big = torch.empty(num_bytes // 4)
        small = torch.zeros(2, dtype=torch.int64)
        half = big.numel() // 2
        timings = []
        for tensor, splits in ((big, [half, half]), (small, [1, 1])):
            out = torch.empty_like(tensor)
            group.all_to_all(out, tensor, splits, splits)
            samples = []
            for _ in range(repeats):
                started = time.perf_counter()
                group.all_to_all(out, tensor, splits, splits)
                samples.append(time.perf_counter() - started)
            timings.append(statistics.median(samples))
        results[r] = (timings[0], timings[1])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for group in groups:
        group.close()
    big_s, small_s = max(r[0] for r in results), max(r[1] for r in results)
    return (num_bytes / 2) / max(big_s - small_s, 1e-9), small_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a MoE checkpoint directory (default: bench.engine's moe, made here)")
    parser.add_argument("--threads", type=int, default=1, help="threads per rank (and at EP 1)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(make_checkpoint("moe", Path(tmp)))
        grid = dict(batch_sizes=BATCH_SIZES, prompt_lens=PROMPT_LENS, repeats=args.repeats)
        shapes1, seconds1 = measure(model, args.threads, **grid)
        fit = CostModel.fit(shapes1, seconds1, f"measured: {model}, {cpu_name()}, {args.threads} threads, EP 1")
        link_bytes_per_s, latency_s = loopback_link()
        host = host_concurrency()
        shapes2, seconds2 = measure(model, args.threads, expert_parallel_size=2, **grid)
        config = load_model_config(model)
    slowdown = max(1.0, 2 / host["two_rank_speedup_bound"])  # a bound measured over 2 is noise

    def errors(compute_slowdown: float) -> list[float]:
        prediction = predict_expert_parallel(fit, config, 2, attention_split=False, dtype_bytes=4,
                                             link_bytes_per_s=link_bytes_per_s, latency_s=latency_s,
                                             compute_slowdown=compute_slowdown)
        return sorted(abs(prediction.step_seconds(s) - t) / t for s, t in zip(shapes2, seconds2))

    host_aware, separate_cores = errors(slowdown), errors(1.0)
    naive = [abs(fit.step_seconds(s) - t) / t for s, t in zip(shapes2, seconds2)]
    print(json.dumps({
        "check": "ep_step", "cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads_per_rank": args.threads,
        "ep1_steps": len(shapes1), "ep2_steps": len(shapes2),
        "stated_error_ep1_fit": round(median_relative_error(fit, shapes1, seconds1), 3),
        "ep2_prediction_median_error": round(statistics.median(host_aware), 3),
        "ep2_prediction_p90_error": round(host_aware[int(0.9 * (len(host_aware) - 1))], 3),
        "ep2_prediction_as_if_separate_cores_median_error": round(statistics.median(separate_cores), 3),
        "two_rank_speedup_bound": round(host["two_rank_speedup_bound"], 3), "compute_slowdown": round(slowdown, 3),
        "ep1_fit_as_ep2_median_error": round(statistics.median(naive), 3),
        "ep2_over_ep1_measured_median": round(statistics.median(seconds2) / statistics.median(seconds1), 3),
        "loopback_gbps_each_way": round(link_bytes_per_s / 1e9, 2), "collective_latency_us": round(latency_s * 1e6, 1),
    }))


if __name__ == "__main__":
    main()
