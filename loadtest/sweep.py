"""Sweep offered load over one or more server configs, and report them overlaid.

    python -m loadtest.sweep --configs serve_configs/default.yaml serve_configs/colocated.yaml \\
        --rates 0.5,1,2 --duration 30 [--out DIR] [locust options, e.g. --workload chat --max-tokens 64]

For each config it deploys the config's application on a Ray Serve instance
of its own, warms it up, and runs headless locust (``loadtest/locustfile.py``,
open loop) at each rate for ``--duration`` seconds, writing
``OUT/<config>/rate-<r>_*.csv``. Then it writes ``OUT/report.md`` and the plots,
one series per config. Options it does not know go to every locust run.

By default it starts a private local Ray (``pd.serve.local.local_serve``) and
shuts Ray and Serve down at the end, also on Ctrl-C, SIGTERM or a failure.
With ``--ray-address`` it uses that cluster (run it on the head node) and
only deletes the applications it deployed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.process import stop_process
from pd.serve.local import local_serve
from pd.workload.records import META_SUFFIX, REQUESTS_SUFFIX, RunMeta, read_requests

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
WARMUP_PREFIX = "warmup-rate-"  # a config's recorded warm-up run (--warmup-duration)
REPO_ROOT = LOCUSTFILE.parents[1]
# Exit codes of locust that still leave a run to report: 0 clean, 1 some requests failed.
LOCUST_REPORTABLE = (0, 1)


@dataclass(frozen=True)
class AppConfig:
    path: Path
    name: str
    route_prefix: str
    import_path: str
    args: dict
    port: int

    @property
    def label(self) -> str:
        return f"{self.args.get('mode', 'app')} ({self.path.name})"

    @classmethod
    def load(cls, path: str | Path) -> "AppConfig":
        path = Path(path)
        config = yaml.safe_load(path.read_text())
        apps = config.get("applications") or []
        if len(apps) != 1:
            raise ValueError(f"{path}: a sweep config holds one application, not {len(apps)}")
        app = apps[0]
        return cls(path=path, name=app.get("name", "default"), route_prefix=app.get("route_prefix", "/"),
                   import_path=app["import_path"], args=app.get("args", {}),
                   port=(config.get("http_options") or {}).get("port", 8000))

    def build(self):
        module, _, attr = self.import_path.partition(":")
        return getattr(importlib.import_module(module), attr)(self.args)


def warm_up(url: str, api_key: str | None) -> None:
    """A short and a long prompt (local and remote prefill), so the first run does not pay for start-up."""
    import requests

    from loadtest import client
    from pd.workload.workloads import long_short, short_long

    with requests.Session() as session:
        options = client.RequestOptions(model=client.fetch_model(session, url, client.RequestOptions(
            model="", api_key=api_key)), api_key=api_key)
        for workload in (short_long(), long_short()):
            request = workload.request(10**9)  # far from the indices the runs use
            body = client.request_body(request, False, options)
            body["max_tokens"] = 4
            result = client.send(session, url, client.COMPLETIONS_PATH, body, options)
            if result.error is not None:
                raise RuntimeError(f"warm-up request to {url} failed: {result.error}")


def run_locust(url: str, prefix: Path, rate: float, duration_s: float, label: str, extra: list[str]) -> int:
    """One headless locust run at ``rate`` requests/s; its exit code. Output goes to ``PREFIX.log``."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
        "-u", "1", "-r", "1", "--run-time", f"{duration_s:g}s", "--csv", str(prefix), "--only-summary",
        "--arrival-rate", f"{rate:g}", "--label", label, *extra,
    ]
    with open(str(prefix) + ".log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            return process.wait(timeout=duration_s + 120)
        finally:
            stop_process(process, timeout_s=15)  # interrupted, or locust hung: stop it, then make sure


def _one_line(prefix: Path, rate: float) -> str:
    from pd.workload.summary import summarize

    records = read_requests(str(prefix) + REQUESTS_SUFFIX)
    meta = RunMeta.read(str(prefix) + META_SUFFIX)
    s = summarize(prefix.name, records, meta)
    return (f"  {rate:g} req/s: {s.num_ok} ok, {s.num_failed} failed, "
            f"{s.num_cutoff} cut off ({s.num_cutoff_lost} past the SLO); TTFT p90 {s.ttft_ms.p90:.0f} ms, "
            f"ITL p90 {s.itl_ms.p90:.1f} ms, attainment {100 * s.attainment:.0f}%")


def sweep_config(local, config: AppConfig, app, rates: list[float], out: Path, url: str, api_key: str | None,
                 args: argparse.Namespace, locust_extra: list[str]) -> None:
    """Deploy ``config``'s app, warm it up, run locust at each rate into ``out``, and delete the app."""
    print(f"{config.label}: deploying", flush=True)
    try:
        local.deploy(app, name=config.name, route_prefix=config.route_prefix, ready_url=url)
    except (RuntimeError, TimeoutError) as exc:
        raise type(exc)(f"{config.path}: {exc}") from None
    warm_up(url, api_key)
    runs = [(f"rate-{rate:g}", rate, args.duration, config.label) for rate in rates]
    if args.warmup_duration > 0:
        runs.insert(0, (f"{WARMUP_PREFIX}{rates[0]:g}", rates[0], args.warmup_duration, f"{config.label} (warm-up)"))
    for name, rate, duration_s, label in runs:
        prefix = out / name
        code = run_locust(url, prefix, rate, duration_s, label, locust_extra)
        if code not in LOCUST_REPORTABLE:
            raise RuntimeError(f"locust exited {code}; see {prefix}.log")
        print(_one_line(prefix, rate), flush=True)
        time.sleep(args.cooldown)
    local.delete(config.name)


def _raise_keyboard_interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", required=True, help="serve config YAML files, one app each")
    parser.add_argument("--rates", required=True, help="offered loads in requests/s, comma-separated")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per rate (default 30)")
    parser.add_argument("--out", help="output directory (default loadtest-runs/sweep-<time>)")
    parser.add_argument("--port", type=int, help="HTTP port (default: the first config's http_options.port)")
    parser.add_argument("--ray-address", default="local", help="'local' (default): a private Ray; or a cluster")
    parser.add_argument("--num-cpus", type=int, help="CPUs of the private Ray (default: all)")
    parser.add_argument("--cooldown", type=float, default=3.0, help="seconds between runs (default 3)")
    parser.add_argument("--warmup-duration", type=float, default=0.0,
                        help="seconds of a recorded run at the first rate before the others, as "
                             f"{WARMUP_PREFIX}<r> (default 0: none); a freshly deployed app serves its "
                             "first minute slower than the next")
    args, locust_extra = parser.parse_known_args(argv)
    rates = [float(rate) for rate in args.rates.split(",") if rate.strip()]
    if not rates or min(rates) <= 0:
        parser.error("--rates needs positive numbers, e.g. 0.5,1,2")
    configs = [AppConfig.load(path) for path in args.configs]
    apps = [config.build() for config in configs]  # a bad config fails here, before Ray starts
    out = Path(args.out or f"loadtest-runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    port = args.port or configs[0].port
    url = f"http://127.0.0.1:{port}"
    api_key = _option(locust_extra, "--api-key") or os.environ.get("LOADTEST_API_KEY") or os.environ.get(
        "OPENAI_API_KEY")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)

    try:
        with local_serve(http_port=port, num_cpus=args.num_cpus, address=args.ray_address) as local:
            try:
                for config, app in zip(configs, apps):
                    sweep_config(local, config, app, rates, out / config.path.stem, url, api_key, args, locust_extra)
            finally:
                print("shutting down Serve and Ray ...", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise SystemExit(130) from None
    finally:
        if any(out.rglob("*" + REQUESTS_SUFFIX)):
            from loadtest.report import write_report

            try:
                print(f"report: {write_report(out)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - keep the sweep's own error, if any, on top
                print(f"could not write the report: {exc!r}", flush=True)


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    main()
