"""Flow control served: the default P/D app under 2x its capacity, three tenants, two bands, as clients see it.

    python -m bench.flow_control [--duration-s 60] [--overload-only]

Starts a private Ray with Serve and deploys ``serve_configs/default.yaml``'s
app (the trained SmolLM2) with ``flow_control:`` (``flow_control_args``): two
bands (interactive: priority 0, TTFT deadline 2 s; batch: priority 1, none)
and three tenants of equal weight, ``a``, ``b`` and ``c``, each named by its
API key. The traffic is ``sim.flow_trace``'s (the simulator's replay, served
for real): Poisson arrivals, ``c`` sending 70% of the requests, 30% of each
tenant's interactive, prompts of random token ids (no prefix shared) and
outputs of 16 to 96 tokens. Each request is sent when its arrival comes
(an open loop) with the project's load-test client (``loadtest.client.send``),
streamed; a 429's ``Retry-After`` is kept.

Runs, each printed as one JSON line, with ``sim.flow_report``'s figures (per
tenant and band: offered, served, shed, TTFT p50/p99, goodput; Jain's index):

1. ``capacity``: requests and tokens per second the app finishes with
   ``--capacity-clients`` clients sending the trace's mix back to back.
2. ``overload``: 2x capacity with flow control; the same trace with nothing
   shed (``no_shed``: no margin, no queue bound), and its interactive
   requests alone (``load_off``). ``shedding``: how soon a 429 came, whether
   the deadline sheds would have missed in ``no_shed``, and each shed's
   ``Retry-After`` (its predicted queue drain, from its timeline) against the
   drain seen: the time until the ingress had dispatched the tokens that were
   ahead of it (sampled from its flow counters every ``SAMPLE_S``).
3. ``moderate``: 0.7x capacity, with flow control and without, each on a fresh deployment.
4. ``quota``: ``c`` alone at 2x capacity with a quota of a third of capacity,
   ``a`` and ``b`` joining at ``--quota-return-s``.

The last line, ``goals``, sets the figures against issue 58's goals 1-4
(``sim.flow.goals``). The CPU and its ISA are named in the first line.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time

from bench.configs import load_config
from bench.flow_load import KEYS, Load, as_run, pool_counters, shed_figures, span_medians
from pd.serve.local import deploy_args, local_serve
from pd.workload.host import cpu_flags, cpu_name
from sim.flow import INTERACTIVE_DEADLINE_S, TENANTS, WARMUP_S, goals, quota_figures
from sim.flow_report import Window, summarize
from sim.flow_trace import FlowArrival, FlowTraceConfig, generate

FLOW_EXTRA: dict = {}  # --flow: fields over every run's flow_control
APP_EXTRA: dict = {}  # --app: fields over every run's app args


def flow_control_args(quota_c_tokens_per_min: int | None = None, shedding: bool = True) -> dict:
    """``sim.flow.default_flow`` as the app's YAML: without ``shedding`` nothing is shed (the replay that shows
    what shedding spared)."""
    unbounded = 1 << 20
    tenants = {name: {"api_keys": [KEYS[name]], "max_queued": 256 if shedding else unbounded,
                      **({"quota_tokens_per_min": quota_c_tokens_per_min}
                         if name == "c" and quota_c_tokens_per_min else {})} for name in TENANTS}
    return {"bands": [{"name": "interactive", "max_priority": 0, "ttft_deadline_ms": INTERACTIVE_DEADLINE_S * 1000},
                      {"name": "batch", "min_priority": 1}],
            "tenants": tenants, "default_tenant": "a", "max_queued": 4096 if shedding else unbounded,
            **FLOW_EXTRA, "shed_margin": FLOW_EXTRA.get("shed_margin", 0.1) if shedding else 1e9}


def merged(base: dict, over: dict) -> dict:
    """``over``'s fields over ``base``'s, section by section."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def app_args(flow: dict | None) -> dict:
    base = merged(load_config("default.yaml")["applications"][0]["args"], APP_EXTRA)
    return {**base, "flow_control": flow, "debug_requests_kept": 20_000, "request_timeout_s": 600}


TRACE: dict = {}  # --prompt-lengths, --output-lengths: the trace's mix


def trace_config(**fields) -> FlowTraceConfig:
    return FlowTraceConfig(**fields, **TRACE)


def measure_capacity(url: str, model: str, clients: int, duration_s: float, seed: int) -> dict:
    """Requests and tokens per second finished by ``clients`` sending the trace's mix back to back."""
    trace = generate(trace_config(rate_rps=100.0, duration_s=duration_s * 2, seed=seed))
    load = Load(url, model)
    start = time.monotonic()
    counter = iter(range(len(trace)))
    lock = threading.Lock()

    def client_loop() -> None:
        while time.monotonic() - start < duration_s:
            with lock:
                index = next(counter)
            load._send(trace[index])

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    window = Window(start + WARMUP_S, start + duration_s)
    done = [(a, load.served[a.request_id]) for a in trace if a.request_id in load.served]
    done = [(a, s) for a, s in done if s.result.error is None and window.holds(s.done_s)]
    tokens = sum(len(a.prompt) + s.result.output_tokens for a, s in done)
    return {"requests_per_s": round(len(done) / window.span_s, 3), "tokens_per_s": round(tokens / window.span_s, 1),
            "clients": clients}


def run_trace(url: str, model: str, trace: list[FlowArrival], flow: dict | None, window: Window) -> tuple:
    load = Load(url, model)
    start = load.run(trace)
    run = as_run(trace, load, start, flow)
    return run, load, summarize(run, window, INTERACTIVE_DEADLINE_S)


def overload_phase(local, url: str, model: str, capacity: dict, args) -> dict:
    trace = generate(trace_config(rate_rps=2 * capacity["requests_per_s"], duration_s=args.duration_s,
                                     seed=args.seed))
    window = Window(WARMUP_S, args.duration_s)
    deploy_args(local, app_args(flow_control_args(shedding=False)), ready_url=url)
    no_shed, _, no_shed_figures = run_trace(url, model, trace, flow_control_args(shedding=False), window)
    deploy_args(local, app_args(flow_control_args()), ready_url=url)
    _, load, figures = run_trace(url, model, trace, flow_control_args(), window)
    figures["controller"] = {**load.controller(), "pools": pool_counters(),
                             "interactive_spans": span_medians(trace, load)}
    _, _, load_off = run_trace(url, model, [a for a in trace if a.interactive], flow_control_args(), window)
    return {"flow_control": figures, "no_shed": no_shed_figures, "load_off": load_off,
            "shedding": shed_figures(trace, load, no_shed)}


def moderate_phase(local, url: str, model: str, capacity: dict, args) -> dict:
    trace = generate(trace_config(rate_rps=0.7 * capacity["requests_per_s"], duration_s=args.duration_s,
                                     seed=args.seed + 1))
    window = Window(WARMUP_S, args.duration_s)
    # Each on a fresh deployment: the app the overload runs left behind holds their cached prefixes and state.
    deploy_args(local, app_args(flow_control_args()), ready_url=url)
    _, _, with_flow = run_trace(url, model, trace, flow_control_args(), window)
    deploy_args(local, app_args(None), ready_url=url)
    _, _, without = run_trace(url, model, trace, None, window)
    return {"flow_control": with_flow, "no_flow_control": without}


def quota_phase(local, url: str, model: str, capacity: dict, args) -> dict:
    """``c`` alone over its quota of a third of capacity, then ``a`` and ``b`` from ``--quota-return-s``."""
    quota_per_min = int(capacity["tokens_per_s"] * 60 / 3)
    flow = flow_control_args(quota_c_tokens_per_min=quota_per_min)
    deploy_args(local, app_args(flow), ready_url=url)
    trace = generate(trace_config(rate_rps=2 * capacity["requests_per_s"], duration_s=args.quota_duration_s,
                                     seed=args.seed + 2, active=(("a", args.quota_return_s, math.inf),
                                                                 ("b", args.quota_return_s, math.inf))))
    run, _, _ = run_trace(url, model, trace, flow, Window(WARMUP_S, args.quota_duration_s))
    return quota_figures(run, quota_per_min, args.quota_return_s, args.quota_duration_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--capacity-clients", type=int, default=8)
    parser.add_argument("--capacity-rps", type=float, default=None, help="skip measuring: requests/s")
    parser.add_argument("--capacity-tokens-per-s", type=float, default=None, help="with --capacity-rps")
    parser.add_argument("--quota-return-s", type=float, default=40.0)
    parser.add_argument("--quota-duration-s", type=float, default=80.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--overload-only", action="store_true", help="the 2x runs alone, no goals line")
    parser.add_argument("--prompt-lengths", default="64,200,400,800", help="the trace's prompt lengths")
    parser.add_argument("--output-lengths", default="16,48,96", help="the trace's output lengths")
    parser.add_argument("--flow", default="{}", help="flow_control fields over the bench's, as JSON")
    parser.add_argument("--app", default="{}", help="app args over default.yaml's, as JSON (e.g. the prefill router)")
    args = parser.parse_args()
    FLOW_EXTRA.update(json.loads(args.flow))
    TRACE.update(prompt_lengths=tuple(int(n) for n in args.prompt_lengths.split(",")),
                 output_lengths=tuple(int(n) for n in args.output_lengths.split(",")))
    APP_EXTRA.update(json.loads(args.app))
    model = load_config("default.yaml")["applications"][0]["args"]["engine"]["model"]
    url = f"http://127.0.0.1:{args.port}"
    print(json.dumps({"bench": "flow_control", "cpu": cpu_name(), "cpu_flags": cpu_flags(), "model": model,
                      "flow": flow_control_args(), "app": APP_EXTRA, "trace": TRACE}), flush=True)
    with local_serve(http_port=args.port) as local:
        deploy_args(local, app_args(None), ready_url=url)
        capacity = ({"requests_per_s": args.capacity_rps, "tokens_per_s": args.capacity_tokens_per_s}
                    if args.capacity_rps is not None else
                    measure_capacity(url, model, args.capacity_clients, args.duration_s, args.seed))
        print(json.dumps({"run": "capacity", **capacity}), flush=True)
        over = overload_phase(local, url, model, capacity, args)
        for name, figures in over.items():
            print(json.dumps({"run": f"overload/{name}", **figures}), flush=True)
        if args.overload_only:
            return
        mod = moderate_phase(local, url, model, capacity, args)
        for name, figures in mod.items():
            print(json.dumps({"run": f"moderate/{name}", **figures}), flush=True)
        quota = quota_phase(local, url, model, capacity, args)
        print(json.dumps({"run": "quota", **quota}), flush=True)
    pressure = {"flow_control": over["flow_control"], "shedding": over["shedding"]}
    print(json.dumps({"run": "goals", **goals(over, pressure, mod, quota)}), flush=True)


if __name__ == "__main__":
    main()
