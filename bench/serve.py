"""Disaggregated against colocated serving, and against vLLM's server, on the built-in model.

``python -m bench.serve [--requests 24] [--concurrency 2] [--vllm auto|off|PYTHON] [--modes ...]``
starts ``serve_configs/default.yaml`` and then ``serve_configs/colocated.yaml``
on a local Ray (``--modes`` adds ``colocated_direct``: the colocated app on a
Ray started with Serve's ``RAY_SERVE_ENABLE_DIRECT_INGRESS``, its clients on
the ingress replica's own HTTP port instead of Serve's proxy;
``colocated_haproxy``: on a Ray started with ``RAY_SERVE_ENABLE_HA_PROXY``,
Serve's HAProxy on the app's port in front of that replica port; and
``colocated_haproxy_throughput``: the same with ``RAY_SERVE_THROUGHPUT_OPTIMIZED``
too; ``disaggregated_traced``: the default app tracing every request over OTLP to
a collector in this process, ``bench.otlp_collector``), sends the same
streamed completions to each (a mix of short prompts, prefilled locally, and
long ones, prefilled remotely), and prints one JSON line per mode with TTFT
and inter-token latency p50/p90 and output tokens/s, then one line with the
disaggregated/colocated ratios of those medians.

With the peer venv (``make peer-venv``), vLLM's OpenAI server
(``vllm.entrypoints.openai.api_server``) serves the same checkpoint, fp32,
prefix caching on, ``VLLM_CPU_OMP_THREADS_BIND`` on two cores, and gets the
same requests after Ray has shut down; a last line gives colocated/vLLM ratios
(goal: output tok/s >= 1.0, TTFT p50 <= 1.2) and the share of identical texts.
``--repeats N`` serves every mode and vLLM's server in turn N times (our modes
in reverse order on odd repeats), each line
tagged with its ``repeat``, and ends with each ratio's median over the repeats
(``median_of``) and its values (``*_each``): on a shared VM a run's TTFT p50
moves by a third with the hour, and only ratios within a repeat compare.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue

import requests

from bench.configs import BENCH_MODEL, bench_app_args, load_config
from bench.otlp_collector import OtlpCollector
from bench.peer import peer_python
from bench.process import stop_process
from loadtest import client
from pd.serve.local import LocalServe, deploy_args, local_serve
from pd.workload.stats import percentile
from pd.workload.workloads import LoadRequest

CONFIGS = {"disaggregated": "default.yaml", "colocated": "colocated.yaml", "colocated_direct": "colocated.yaml",
           "colocated_haproxy": "colocated.yaml", "colocated_haproxy_throughput": "colocated.yaml",
           "disaggregated_traced": "default.yaml"}
# Modes whose app traces every request (otlp_traces_endpoint) to a collector in this process (bench.otlp_collector).
TRACED_MODES = {"disaggregated_traced"}
# Modes served without Serve's Python proxy, on a Ray started with Serve's variables for it: by the ingress
# replica's own HTTP server (clients on its port), or by HAProxy in front of it (clients on the app's port),
# and with Serve's throughput-optimized settings (handle calls over gRPC, user code on the replica's own loop).
MODE_ENV = {"colocated_direct": ("RAY_SERVE_ENABLE_DIRECT_INGRESS",),
            "colocated_haproxy": ("RAY_SERVE_ENABLE_HA_PROXY",),
            "colocated_haproxy_throughput": ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED")}
DIRECT_MODES = {"colocated_direct"}


# The request every mode and vLLM's server get: greedy, to the full length, streamed.
OPTIONS = client.RequestOptions(model=BENCH_MODEL, temperature=0.0)


def stream_one(session: requests.Session, base_url: str, prompt: str,
               max_tokens: int) -> tuple[float, list[float], str]:
    """(TTFT, inter-token gaps, text) of one streamed completion (``loadtest.client``, which stamps each chunk).

    Raises ``RuntimeError`` with the client's error (an HTTP error, an error
    event, an empty stream): a benchmark's figures are of complete answers only.
    """
    body = client.request_body(LoadRequest(0, "bench", max_tokens, prompt=prompt), chat=False, options=OPTIONS)
    result = client.send(session, base_url, client.COMPLETIONS_PATH, body, OPTIONS)
    if result.error is not None:
        raise RuntimeError(result.error)
    return result.ttft_s, result.itl_s, result.text


@dataclass
class LoadResult:
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)  # prompt index -> completion text
    wall_s: float = 0.0
    num_spans: int = 0  # the spans a traced mode's app exported


def load(base_url: str, prompts: list[str], max_tokens: int, concurrency: int) -> LoadResult:
    """Stream every prompt to ``base_url``'s completions, ``concurrency`` at a time."""
    pending: SimpleQueue[int] = SimpleQueue()
    for index in range(len(prompts)):
        pending.put(index)
    result = LoadResult()

    def worker() -> None:
        with requests.Session() as session:  # one per thread: a Session is not thread-safe
            while True:
                try:
                    index = pending.get_nowait()
                except Empty:
                    return
                ttft, itl, text = stream_one(session, base_url, prompts[index], max_tokens)
                result.ttfts.append(ttft)
                result.gaps.extend(itl)
                result.texts[index] = text

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for done in [pool.submit(worker) for _ in range(concurrency)]:
            done.result()  # re-raises a worker's failure
    result.wall_s = time.perf_counter() - start
    return result


def summarise(mode: str, result: LoadResult, max_tokens: int) -> dict:
    ttfts, gaps = result.ttfts, result.gaps
    return {
        "mode": mode, "requests": len(ttfts),
        "ttft_p50_ms": round(1e3 * percentile(ttfts, 50), 1), "ttft_p90_ms": round(1e3 * percentile(ttfts, 90), 1),
        "itl_p50_ms": round(1e3 * percentile(gaps, 50), 2), "itl_p90_ms": round(1e3 * percentile(gaps, 90), 2),
        "output_tok_s": round(len(ttfts) * max_tokens / result.wall_s, 1),
    }


def direct_ingress_port(timeout_s: float = 60.0) -> int:
    """The port the ingress replica serves HTTP on itself: the first of Serve's direct-ingress range that lists our model."""
    from autoscale.ray_internals import direct_ingress_ports

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for port in direct_ingress_ports():
            try:
                models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=0.5)
            except requests.RequestException:
                continue
            if models.status_code == 200 and BENCH_MODEL in models.text:
                return port
        time.sleep(1)  # polling ports that open when the replica's server is up: nothing to wait on
    raise RuntimeError(f"no ingress replica answered on Serve's direct-ingress ports within {timeout_s} s")


def run_mode(mode: str, local: LocalServe, prompts: list[str], args) -> LoadResult:
    """One mode's app deployed on ``local``, a warm-up and the timed load; the app is deleted after."""
    config = load_config(CONFIGS[mode])
    port = config["http_options"]["port"]
    app_args = bench_app_args(config)
    collector = None
    if mode in TRACED_MODES:
        collector = OtlpCollector()
        app_args["otlp_traces_endpoint"] = collector.url
    deploy_args(local, app_args)
    if mode in DIRECT_MODES:
        port = direct_ingress_port()
    url = f"http://127.0.0.1:{port}"
    load(url, prompts[:4], args.max_tokens, args.concurrency)  # warm-up
    result = load(url, prompts[4:], args.max_tokens, args.concurrency)
    local.delete("pd")
    if collector is not None:
        result.num_spans = collector.count()
        collector.close()
    return result


def run_vllm(python: Path, prompts: list[str], args) -> LoadResult:
    """The same load against vLLM's OpenAI server on the built-in checkpoint; the server is stopped after."""
    from bench.peer import cpu_list
    from pd.model.paths import resolve_model_path

    port = 8011
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu_list(2), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONPATH", None)
    server = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_path(BENCH_MODEL)),
         "--served-model-name", BENCH_MODEL, "--dtype", "float32", "--enable-prefix-caching",
         "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", server, timeout_s=300)
        url = f"http://127.0.0.1:{port}"
        load(url, prompts[:4], args.max_tokens, args.concurrency)  # warm-up
        return load(url, prompts[4:], args.max_tokens, args.concurrency)
    finally:
        stop_process(server, timeout_s=60)


def first_difference(ours: dict[int, str], theirs: dict[int, str], differ: list[int]) -> dict | None:
    """Where the first differing pair of texts parts, with a little of each side from there."""
    if not differ:
        return None
    a, b = ours.get(differ[0], ""), theirs[differ[0]]
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"request": differ[0], "char": at, "ours": a[at : at + 12], "vllm": b[at : at + 12]}


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    """Until ``url`` answers 200; fails at once if the server exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {server.returncode}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)  # polling a readiness endpoint: there is nothing to wait on
    raise RuntimeError(f"the vLLM server was not ready within {timeout_s} s")


def serve_modes(modes: list[str], prompts: list[str], args, repeat: int) -> dict[str, LoadResult]:
    """Each of ``modes`` on a fresh app, under the same load; a line per mode as it finishes."""
    loads = {}
    # Serve's proxy is a setting of the whole Ray cluster: each such mode gets a Ray of its own, started with it.
    groups = [[mode for mode in modes if mode not in MODE_ENV]] + [[mode] for mode in modes if mode in MODE_ENV]
    for group in groups:
        if not group:
            continue
        env = dict.fromkeys(MODE_ENV.get(group[0], ()), "1")
        port = load_config(CONFIGS[group[0]])["http_options"]["port"]
        with local_serve(http_port=port, env=env) as local:
            for mode in group:
                loads[mode] = run_mode(mode, local, prompts, args)
                print(json.dumps({**summarise(mode, loads[mode], args.max_tokens), "repeat": repeat}), flush=True)
    return loads


def ratios(loads: dict[str, LoadResult], max_tokens: int) -> list[dict]:
    """One repeat's ratios: disaggregated over colocated, and each of our modes over vLLM's server."""
    results = {mode: summarise(mode, result, max_tokens) for mode, result in loads.items()}
    lines = []
    if {"disaggregated", "disaggregated_traced"} <= results.keys():
        d, t = results["disaggregated"], results["disaggregated_traced"]
        lines.append({"case": "ratio_traced_over_untraced",
                      "output_tok_s": round(t["output_tok_s"] / d["output_tok_s"], 3),
                      "ttft_p50": round(t["ttft_p50_ms"] / d["ttft_p50_ms"], 3),
                      "itl_p50": round(t["itl_p50_ms"] / d["itl_p50_ms"], 3),
                      "spans": loads["disaggregated_traced"].num_spans})
    if {"disaggregated", "colocated"} <= results.keys():
        d, c = results["disaggregated"], results["colocated"]
        lines.append({"case": "ratio_disaggregated_over_colocated",
                      "ttft_p50": round(d["ttft_p50_ms"] / c["ttft_p50_ms"], 3),
                      "itl_p50": round(d["itl_p50_ms"] / c["itl_p50_ms"], 3)})
    for mode in CONFIGS:
        if mode in results and "vllm" in results:
            ours, peer = results[mode], results["vllm"]
            differ = [i for i, text in loads["vllm"].texts.items() if loads[mode].texts.get(i) != text]
            lines.append({"case": f"ratio_{mode}_over_vllm",
                          "output_tok_s": round(ours["output_tok_s"] / peer["output_tok_s"], 3),
                          "ttft_p50": round(ours["ttft_p50_ms"] / peer["ttft_p50_ms"], 3),
                          "itl_p50": round(ours["itl_p50_ms"] / peer["itl_p50_ms"], 3),
                          "same_text": round(1 - len(differ) / len(loads["vllm"].texts), 3),
                          "first_difference": first_difference(loads[mode].texts, loads["vllm"].texts, differ)})
    return lines


def median_ratios(per_repeat: list[list[dict]]) -> list[dict]:
    """Each ratio's median over the repeats, with every repeat's value."""
    by_case: dict[str, list[dict]] = {}
    for lines in per_repeat:
        for line in lines:
            by_case.setdefault(line["case"], []).append(line)
    medians = []
    for case, lines in by_case.items():
        keys = [key for key, value in lines[0].items() if isinstance(value, float)]
        medians.append({"case": case, "median_of": len(lines),
                        **{key: round(percentile([line[key] for line in lines], 50), 3) for key in keys},
                        **{f"{key}_each": [line[key] for line in lines] for key in keys}})
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="disaggregated,colocated")
    parser.add_argument("--vllm", default="auto", help="auto, off, or the python of a venv with vllm-cpu")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every mode and vLLM's server in turn; with more than one, a last line each "
                             "gives the ratios' medians")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    rng = random.Random(0)
    words = "the sea block table cache token prefill decode river mountain".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.choice([20, 40, 300, 500])))
               for _ in range(args.requests + 4)]
    modes = list(dict.fromkeys(args.modes.split(",")))
    unknown = sorted(set(modes) - CONFIGS.keys())
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {sorted(CONFIGS)}")
    vllm_python = peer_python(args.vllm)
    per_repeat = []
    for repeat in range(args.repeats):
        # Odd repeats serve the modes in reverse: a mode served second on a warm Ray ran up to 6% apart
        # from the same mode served first, more than some differences measured here.
        loads = serve_modes(modes if repeat % 2 == 0 else modes[::-1], prompts, args, repeat)
        if vllm_python is not None:
            loads["vllm"] = run_vllm(vllm_python, prompts, args)
            print(json.dumps({**summarise("vllm", loads["vllm"], args.max_tokens), "repeat": repeat}), flush=True)
        per_repeat.append(ratios(loads, args.max_tokens))
        for line in per_repeat[-1]:
            print(json.dumps({**line, "repeat": repeat}), flush=True)
    if args.repeats > 1:
        for line in median_ratios(per_repeat):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
