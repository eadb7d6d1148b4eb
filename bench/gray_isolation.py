"""Gray failures, served: ITL p99 over time while one of a pool's two replicas is made slow for real, and after.

    python -m bench.gray_isolation --out /tmp/gray                    # a 5x slow decode replica, 20 s to 60 s
    python -m bench.gray_isolation --no-fault --bursty --duration-s 600 --out /tmp/calm   # false positives?
    python -m bench.gray_isolation --pool prefill --out /tmp/p        # a 5x slow prefill replica, long prompts
    python -m bench.gray_isolation --pool prefill --clients 1 --think-s 3 --out /tmp/light  # ... at a light load

Starts a private Ray with Serve and deploys ``serve_configs/default.yaml``'s
app (the built-in tiny model) with two decode replicas (``--pool prefill``:
two prefill replicas, and every prompt long), the gray-failure detector on
their router (``router.gray``; its defaults, or ``--gray`` JSON) and one
migration per stream. Clients stream completions: ``--clients`` of them,
each one after another (a mix of short prompts, decoded where they are
prefilled, and long ones, prefilled remotely), or with ``--bursty`` as many
of them as the load tests' bursty profile gives at that moment
(``BurstyTraceConfig.rate_per_s``: a diurnal ramp with a 3x step, over the
run); ``--think-s`` pauses each client between its streams (a light load).
With a fault, the busiest replica of that pool (``--pool prefill``: the one
that computed the most prompt tokens) has its process stopped and resumed on
a duty cycle (``SIGSTOP``/``SIGCONT``, 16 ms of every 20: five times slower,
alive, its health checks passing) from ``--fault-at`` for ``--fault-for``
seconds. Each second the ingress's quarantined replicas, its suspects
(``router.gray.probe_targets``: measured slow, probed) and every replica's
slowness are recorded, and for the prefill pool each replica's computed
prompt tokens.

Prints one JSON object, and writes it with a PNG of ITL p99 over time (the
fault shaded, the quarantine and readmission marked) under ``--out``: the
ITL p99 of each ``--bucket-s`` bucket; ``itl_p99_baseline_s`` (before the
fault); ``itl_p99_quarantined_s`` (from ``--settle-s`` after the quarantine to
the fault's end) and their ratio (goal: <= 1.5); from the quarantine to the
fault's end, the slowest stream's own ITL over the median stream's
(``slowest_stream_over_median``; goal: under the detector's ``slow_factor``,
3: no stream stays on the slow replica); ``suspect_after_s`` (a probe target,
from the fault's start), ``quarantined_after_s`` (goal: <= 30) and
``readmitted_after_s`` (from the fault's end); with ``--pool prefill``, the
prompt tokens each replica computed during the fault before the quarantine
(``fault_tokens_before_quarantine``: the evidence the detector had, probes
included); every quarantine change; and the streams that did not finish
(goal: none).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

from bench.configs import BENCH_MODEL, bench_app_args, load_config
from pd.serve.local import deploy_args, local_serve, pool_stats
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.trace import BurstyTraceConfig
from router.gray import probe_targets

LONG_PROMPT = " ".join(f"word{i}" for i in range(300))  # past the default remote-prefill threshold
STOPPED_S, PERIOD_S = 0.016, 0.02  # five times slower; short, so that stops land inside steps
DEPLOYMENTS = {"prefill": "PrefillServer", "decode": "DecodeServer"}


class StreamingLoad:
    """Clients streaming completions one after another; every token's arrival time and every stream's outcome.

    ``active(t)`` (seconds since the start) is how many of the ``clients``
    send at that moment: all of them by default.
    """

    def __init__(self, url: str, clients: int = 6, max_tokens: int = 48, model: str = BENCH_MODEL,
                 active=None, long_every: int = 0, think_s: float = 0.0):
        self.url, self.max_tokens, self.model = urllib.parse.urlsplit(url), max_tokens, model
        self.active = active or (lambda t: clients)
        self.long_every = long_every  # every n-th stream of a client has a long prompt (0: none)
        self.think_s = think_s  # each client's pause between its streams
        self.outcomes: list[str] = []
        self.gaps: list[tuple[float, float]] = []  # (arrival time, gap since the stream's previous token)
        self.arrivals: list[list[float]] = []  # each stream's token arrival times
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> "StreamingLoad":
        self.started = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _run(self, index: int) -> None:
        count = 0
        while not self._stop.is_set():
            if index >= self.active(time.monotonic() - self.started):
                self._stop.wait(0.25)  # this client is idle in this part of the profile: look again soon
                continue
            count += 1
            long = self.long_every and count % self.long_every == 0
            self.outcomes.append(self._one(LONG_PROMPT if long else "tell me"))
            self._stop.wait(self.think_s)  # a client's pause between streams, not synchronisation

    def _one(self, text: str) -> str:
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({
                "model": self.model, "prompt": f"{uuid.uuid4().hex} {text}", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                return f"status {response.status}"
            last, events, arrivals = None, [], []
            self.arrivals.append(arrivals)
            for line in response:
                if line.startswith(b"data: {"):
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append((now, now - last))
                    last = now
                    arrivals.append(now)
                    events.append(json.loads(line[6:]))
            finish = events[-1]["choices"][0]["finish_reason"] if events and events[-1].get("choices") else None
            return "done" if finish == "length" else f"ended {events[-1] if events else 'empty'}"
        except Exception as exc:  # noqa: BLE001 - any failure is an outcome the caller reports
            return f"failed {exc!r}"
        finally:
            conn.close()

    def itl_p99(self, since: float, until: float, min_gaps: int = 50) -> float:
        gaps = sorted(gap for at, gap in self.gaps if since <= at < until)
        if len(gaps) < min_gaps:
            raise ValueError(f"only {len(gaps)} tokens between {since:.1f} and {until:.1f}")
        return gaps[int(0.99 * (len(gaps) - 1))]

    def stream_itls(self, since: float, until: float, min_gaps: int = 24) -> list[float]:
        """Each stream's own ITL between ``since`` and ``until``: the median of its gaps that arrived then.

        A stall of the whole host (a neighbour taking the CPU) lands on a gap
        or two of every stream and moves none of these; a stream decoded by a
        slow replica has nearly every gap slow. Streams with fewer than
        ``min_gaps`` gaps there (by default half of a 48-token stream's) are
        left out: a stretch that short, one longer stall can cover whole.
        """
        itls = []
        for arrivals in list(self.arrivals):
            gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if since <= b < until]
            if len(gaps) >= min_gaps:
                itls.append(statistics.median(gaps))
        return itls


class DutyCycle:
    """Stops and resumes a process on a duty cycle until closed; the process is always left running."""

    def __init__(self, pid: int, stopped_s: float = STOPPED_S, period_s: float = PERIOD_S):
        self.pid, self.stopped_s, self.period_s = pid, stopped_s, period_s
        self.gone = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "DutyCycle":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)
        if not self.gone:
            os.kill(self.pid, signal.SIGCONT)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._stop.wait(self.stopped_s)
                os.kill(self.pid, signal.SIGCONT)
                self._stop.wait(self.period_s - self.stopped_s)
        except ProcessLookupError:  # the process is gone (Serve replaced its replica)
            self.gone = True


def ingress_stats() -> dict:
    from ray import serve

    return serve.get_app_handle("pd").process_stats.remote().result()


def app_args(model: str, gray: dict[str, float], pool: str = "decode") -> dict:
    """The default app serving ``model``, with two ``pool`` replicas watched by the gray-failure detector."""
    base = bench_app_args(load_config("default.yaml"), model)
    watched = {**base[pool], "num_replicas": 2, "router": {**base[pool].get("router", {}), "gray_failure": gray}}
    return {**base, pool: watched, "max_migrations": 1}


def bursty_clients(clients: int, duration_s: float):
    """How many of ``clients`` send at time ``t``: in proportion to the bursty profile's rate then."""
    profile = BurstyTraceConfig(duration_s=duration_s)
    peak = max(profile.rate_per_s(t) for t in range(int(duration_s) + 1))
    return lambda t: max(1, round(clients * profile.rate_per_s(min(t, duration_s)) / peak))


def watch(load: StreamingLoad, args) -> tuple[list[dict], dict | None]:
    """Sample the ingress's quarantine each second, and run the fault from ``fault_at`` for ``fault_for``."""
    samples, fault, slow = [], None, None
    fault_end = args.fault_at + args.fault_for
    busiest = "num_computed_prompt_tokens" if args.pool == "prefill" else "num_running"
    while (t := time.monotonic() - load.started) < args.duration_s:
        if args.fault and fault is None and t >= args.fault_at and slow is None:
            slow = max(pool_stats(DEPLOYMENTS[args.pool]), key=lambda s: s[busiest])
            fault = DutyCycle(slow["pid"]).__enter__()
        if fault is not None and t >= fault_end:
            fault.__exit__(None, None, None)
            fault = None
        stats = ingress_stats()
        quarantined, slowness = stats["quarantined"][args.pool], stats["slowness"][args.pool]
        samples.append({"t_s": round(t, 2), "quarantined": quarantined,
                        "suspects": [r for r in probe_targets(quarantined, slowness) if r not in quarantined],
                        "slowness": {k[-8:]: round(v, 2) for k, v in slowness.items()}})
        if args.pool == "prefill":
            samples[-1]["computed_tokens"] = {s["replica_id"][-8:]: s["num_computed_prompt_tokens"]
                                              for s in pool_stats(DEPLOYMENTS[args.pool])}
        readmitted = slow is not None and t > fault_end + 5 and not samples[-1]["quarantined"] and any(
            s["quarantined"] for s in samples)
        if readmitted and t > fault_end + args.after_s:
            break
        time.sleep(max(0.0, load.started + t + 1.0 - time.monotonic()))  # the next sample, a second on
    if fault is not None:
        fault.__exit__(None, None, None)
    return samples, slow


def summarise(load: StreamingLoad, samples: list[dict], slow: dict | None, args) -> dict:
    t0, end = load.started, load.started + samples[-1]["t_s"]
    buckets = []
    for start in range(0, int(end - t0), args.bucket_s):
        gaps = sorted(g for at, g in load.gaps if t0 + start <= at < t0 + start + args.bucket_s)
        buckets.append({"t_s": start, "itl_p99_s": round(gaps[int(0.99 * (len(gaps) - 1))], 4) if len(gaps) >= 10
                        else None, "tokens": len(gaps)})
    changes, held = [], []
    for sample in samples:
        if sample["quarantined"] != held:
            held = sample["quarantined"]
            changes.append({"t_s": sample["t_s"], "quarantined": [r[-8:] for r in held]})
    result = {"bench": "gray_isolation", "pool": args.pool, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
              "model": args.model, "clients": args.clients, "think_s": args.think_s, "gray": json.loads(args.gray),
              "fault": args.fault, "bursty": args.bursty, "duration_s": samples[-1]["t_s"],
              "streams": len(load.outcomes), "failed_streams": [o for o in load.outcomes if o != "done"][:10],
              "num_failed_streams": sum(o != "done" for o in load.outcomes),
              "itl_median_s": round(statistics.median(g for _, g in load.gaps), 4), "changes": changes,
              "num_quarantines": sum(1 for c in changes if c["quarantined"]), "buckets": buckets}
    if slow is None:
        return result
    fault_end = args.fault_at + args.fault_for
    held_at = next((c["t_s"] for c in changes if slow["replica_id"][-8:] in c["quarantined"]), None)
    freed_at = next((c["t_s"] for c in changes if not c["quarantined"] and c["t_s"] > fault_end), None)
    suspect_at = next((s["t_s"] for s in samples if s["t_s"] >= args.fault_at and slow["replica_id"] in
                       (*s["suspects"], *s["quarantined"])), None)
    result.update(slow_replica=slow["replica_id"][-8:], fault_at_s=args.fault_at, fault_end_s=fault_end,
                  itl_p99_baseline_s=round(load.itl_p99(t0 + args.warmup_s, t0 + args.fault_at), 4),
                  suspect_after_s=None if suspect_at is None else round(suspect_at - args.fault_at, 1),
                  quarantined_after_s=None if held_at is None else round(held_at - args.fault_at, 1),
                  readmitted_after_s=None if freed_at is None else round(freed_at - fault_end, 1))
    if args.pool == "prefill":
        result["fault_tokens_before_quarantine"] = _computed_between(samples, args.fault_at, held_at or fault_end)
    if held_at is not None and held_at + args.settle_s < fault_end:
        quarantined = load.itl_p99(t0 + held_at + args.settle_s, t0 + fault_end)
        itls = load.stream_itls(t0 + held_at, t0 + fault_end)
        result.update(itl_p99_quarantined_s=round(quarantined, 4),
                      ratio=round(quarantined / result["itl_p99_baseline_s"], 3),
                      slowest_stream_over_median=round(max(itls) / statistics.median(itls), 2) if itls else None)
    return result


def _computed_between(samples: list[dict], start_s: float, end_s: float) -> dict[str, int]:
    """The prompt tokens each prefill replica computed between the samples nearest ``start_s`` and ``end_s``."""
    first = next(s for s in samples if s["t_s"] >= start_s)
    last = [s for s in samples if s["t_s"] <= end_s][-1]
    return {r: last["computed_tokens"].get(r, 0) - tokens for r, tokens in first["computed_tokens"].items()}


def write_plot(path: Path, result: dict) -> None:
    """ITL p99 over time: the fault shaded, the baseline and 1.5x of it drawn, quarantine changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

    fig, ax = plt.subplots(figsize=(9, 3.6))
    points = [(b["t_s"], b["itl_p99_s"] * 1000) for b in result["buckets"] if b["itl_p99_s"] is not None]
    ax.plot([t for t, _ in points], [v for _, v in points], marker="o", markersize=3, label="ITL p99 (ms)")
    if result.get("fault_at_s") is not None:
        ax.axvspan(result["fault_at_s"], result["fault_end_s"], color="tab:red", alpha=0.12,
                   label=f"one {result['pool']} replica 5x slow")
    if result.get("itl_p99_baseline_s"):
        baseline = result["itl_p99_baseline_s"] * 1000
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label="baseline p99")
        ax.axhline(1.5 * baseline, color="gray", linestyle=":", linewidth=1, label="1.5x baseline")
    for change in result["changes"]:
        ax.axvline(change["t_s"], color="tab:purple" if change["quarantined"] else "tab:green", linewidth=1.2)
        ax.annotate("quarantined" if change["quarantined"] else "readmitted", (change["t_s"], ax.get_ylim()[1]),
                    rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("ITL p99 (ms)")
    ax.set_title(f"Gray failure isolation ({result['cpu']}, {', '.join(result['cpu_flags'])})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH_MODEL)
    parser.add_argument("--pool", choices=sorted(DEPLOYMENTS), default="decode",
                        help="the pool with two replicas, one of them made slow (prefill: every prompt long)")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--think-s", type=float, default=0.0, help="each client's pause between its streams")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gray", default="{}", help="router.gray.GrayFailureConfig fields, as JSON")
    parser.add_argument("--no-fault", dest="fault", action="store_false")
    parser.add_argument("--bursty", action="store_true", help="active clients follow the bursty profile")
    parser.add_argument("--fault-at", type=float, default=20.0)
    parser.add_argument("--fault-for", type=float, default=40.0)
    parser.add_argument("--after-s", type=float, default=10.0, help="run on this long once readmitted")
    parser.add_argument("--duration-s", type=float, default=120.0, help="at most")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=3.0, help="after the quarantine, before measuring")
    parser.add_argument("--bucket-s", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write result.json and itl_p99.png here")
    args = parser.parse_args()
    gray = json.loads(args.gray)
    with local_serve(http_port=args.port, num_cpus=args.num_cpus) as local:
        url = f"http://127.0.0.1:{args.port}"
        deploy_args(local, app_args(args.model, gray, args.pool), ready_url=url)
        active = bursty_clients(args.clients, args.duration_s) if args.bursty else None
        long_every = 1 if args.pool == "prefill" else 4  # prefill: every prompt goes to the prefill pool
        with StreamingLoad(url, args.clients, args.max_tokens, args.model, active, long_every,
                           args.think_s) as load:
            samples, slow = watch(load, args)
    result = summarise(load, samples, slow, args)
    print(json.dumps(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps({**result, "samples": samples}, indent=1))
        write_plot(args.out / "itl_p99.png", result)


if __name__ == "__main__":
    main()
