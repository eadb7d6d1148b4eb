"""Load testing: workloads, the streaming client's checks, the report, and locust against the default app.

Locust runs as a subprocess, as users run it: it monkey-patches the stdlib for
gevent, which must not happen inside pytest.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from loadtest import client
from loadtest.report import write_report
from pd.workload.records import RequestLog, RequestRecord, RunMeta, Status, read_requests
from pd.workload.summary import load_runs, lost_before_cutoff, operating_points, summarize
from pd.workload.workloads import ChatWorkload, arrivals, make_workload, trace_arrivals

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


def _locust(host: str, csv_prefix: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
               "--csv", str(csv_prefix), "--only-summary", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _stats(csv_prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


# Workloads ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chat", "long-short", "short-long", "mixed"])
def test_workloads_are_deterministic_from_the_seed(name):
    first = [make_workload(name, seed=3).request(i) for i in range(40)]
    again = [make_workload(name, seed=3).request(i) for i in range(40)]
    other = [make_workload(name, seed=4).request(i) for i in range(40)]
    assert first == again
    assert first != other
    assert all(r.max_tokens >= 1 for r in first)


def test_workload_lengths_follow_their_settings():
    long = make_workload("long-short", args={"prompt_len": "500", "len_spread": "0"}, max_tokens=7)
    short = make_workload("short-long")
    request = long.request(0)
    assert len(request.prompt.split()) == 500 and request.max_tokens == 7
    assert all(short.request(i).max_tokens > 4 * len(short.request(i).prompt.split()) for i in range(20))
    with pytest.raises(ValueError, match="prompt_lenn"):
        make_workload("long-short", args={"prompt_lenn": "5"})
    mixed = make_workload("mixed", args={"chat_weight": "0", "short_long_weight": "0",
                                         "long_short.prompt_len": "64"})
    assert {mixed.request(i).kind for i in range(20)} == {"long-short"}


def test_chat_turns_extend_their_conversation_and_share_system_prompts():
    chat = ChatWorkload(num_system_prompts=2, num_turns=3, group_size=4)
    turns = [chat.request(member + 4 * turn) for turn in range(3) for member in (1,)]
    for earlier, later in itertools.pairwise(turns):
        assert later.messages[: len(earlier.messages)] == earlier.messages
        assert len(later.messages) == len(earlier.messages) + 2
    systems = {chat.request(i).messages[0] for i in range(8)}
    assert len(systems) == 2


def test_trace_replay_keeps_shared_blocks_and_arrival_times(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 10, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 12, "output_length": 3, "hash_ids": [7, 8, 10]},
        {"timestamp": 3000, "input_length": 6, "output_length": 900, "hash_ids": [11, 7]},
    ]
    trace.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    workload = make_workload("trace", trace_file=str(trace), args={"block_size": "4"}, max_tokens=100)
    a, b, c = (workload.request(i) for i in range(3))
    assert [len(r.prompt) for r in (a, b, c)] == [10, 12, 6]
    assert a.prompt[:8] == b.prompt[:8] and a.prompt[8:10] != b.prompt[8:10]
    assert c.prompt[4:6] == a.prompt[:2]  # block 7, second in this prompt
    assert [r.max_tokens for r in (a, b, c)] == [5, 3, 100]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.5, 2.0]
    assert [at for at, _ in trace_arrivals(workload, rate=2.0)] == [0.0, 0.25, 1.0]
    assert workload.num_requests == 3
    with pytest.raises(ValueError, match="not a Mooncake trace record"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"timestamp": 1}\n')
        make_workload("trace", trace_file=str(bad)).num_requests  # noqa: B018


@pytest.mark.parametrize("process", ["poisson", "constant"])
def test_open_loop_arrivals_hold_their_rate(process):
    times = [at for at, _ in itertools.islice(arrivals(4.0, process, seed=1), 4001)]
    assert times == [at for at, _ in itertools.islice(arrivals(4.0, process, seed=1), 4001)]
    assert times[-1] / 4000 == pytest.approx(0.25, rel=0.05)
    assert all(b >= a for a, b in itertools.pairwise(times))


# The client's content checks, against a scripted server ---------------------------

MODEL = "fake-model"


def _sse(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def _chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


SCRIPTS = {
    "ok": [_chunk("a"), _chunk("b"), _chunk("c"), {"choices": [], "usage": {"prompt_tokens": 4,
                                                                           "completion_tokens": 3}}, "[DONE]"],
    "empty": ["[DONE]"],
    "no-done": [_chunk("a"), _chunk("b")],
    "error-chunk": [_chunk("a"), {"error": {"message": "decode replica died"}}, "[DONE]"],
    "slow": [_chunk("a")] + [_chunk("b")] * 100 + ["[DONE]"],
}


class _ScriptedServer(BaseHTTPRequestHandler):
    """Streams ``SCRIPTS[prompt]`` as chunked SSE: the first chunk after 0.2 s, the rest 0.05 s apart."""

    protocol_version = "HTTP/1.1"
    default_script = "ok"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body.get("prompt")
        script = prompt if prompt in (*SCRIPTS, "http-500") else self.default_script
        if script == "http-500":
            self._json(500, {"error": {"message": "boom"}})
            return
        if not body.get("stream"):
            time.sleep(0.2)
            self._json(200, {"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i, event in enumerate(SCRIPTS[script]):
                time.sleep(0.2 if i == 0 else 0.05)
                data = _sse(event)
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _json(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def scripted_server(request):
    handler = type("Handler", (_ScriptedServer,), {"default_script": getattr(request, "param", "ok")})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("script, error", [
    ("ok", None),
    ("empty", "empty stream"),
    ("no-done", "stream ended without [DONE]"),
    ("error-chunk", "error chunk: decode replica died"),
    ("http-500", "HTTP 500: boom"),
])
def test_client_judges_streams_on_content(scripted_server, script, error):
    options = client.RequestOptions(model=MODEL)
    body = {"model": MODEL, "prompt": script, "max_tokens": 3, "stream": True}
    with requests.Session() as session:
        assert client.fetch_model(session, scripted_server, options) == MODEL
        result = client.send(session, scripted_server, client.COMPLETIONS_PATH, body, options)
    assert result.error == error
    if error is None:
        # Lower bounds only: sleeps can run long on a busy machine, never short.
        whole = client.send(requests.Session(), scripted_server, client.COMPLETIONS_PATH, {**body, "stream": False},
                            options)
        assert whole.error is None and whole.ttft_s >= 0.2 and whole.ttft_s == pytest.approx(whole.e2e_s, abs=0.05)
        assert whole.output_tokens == 3 and whole.itl_s == []
        assert result.ttft_s >= 0.2 and len(result.itl_s) == 2 and min(result.itl_s) >= 0.045
        assert result.output_tokens == 3 and result.prompt_tokens == 4
        assert result.tpot_s == pytest.approx((result.e2e_s - result.ttft_s) / 2)


@pytest.mark.integration  # locust in a subprocess
@pytest.mark.parametrize("scripted_server, exit_code, status", [("slow", 0, Status.CUTOFF),
                                                                ("error-chunk", 1, Status.FAILED)],
                         indirect=["scripted_server"], ids=["cut-off-at-the-end", "error-chunks"])
def test_locust_counts_content_failures_but_not_requests_cut_off(scripted_server, tmp_path, exit_code, status):
    prefix = tmp_path / "locust"
    done = _locust(scripted_server, prefix, "-u", "2", "-r", "2", "--run-time", "3s", "--workload", "short-long")
    assert done.returncode == exit_code, done.stderr[-3000:]
    records = read_requests(f"{prefix}_requests.csv")
    statuses = [r.status for r in records]
    assert status in statuses and set(statuses) <= {status, Status.CUTOFF}
    e2e = [row for (kind, _), row in _stats(prefix).items() if kind == "E2E"]
    assert sum(int(row["Failure Count"]) for row in e2e) == statuses.count(Status.FAILED)
    if status == Status.CUTOFF:  # logged with what they had when the run ended
        assert all(r.ttft_ms >= 200 and r.num_chunks >= 1 and r.e2e_ms > r.ttft_ms for r in records)
    meta = RunMeta.read(f"{prefix}_meta.json")
    assert meta.model == MODEL and meta.end_time > meta.start_time


@pytest.mark.integration  # locust in a subprocess
def test_trace_replay_keeps_arrival_times_and_ends_the_run(scripted_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 500 * i, "input_length": 20, "output_length": 3,
                                         "hash_ids": [1, i]}) + "\n" for i in range(5)))
    prefix = tmp_path / "locust"
    started = time.monotonic()
    done = _locust(scripted_server, prefix, "--run-time", "60s", "--trace-file", str(trace),
                   "--workload-args", "block_size=16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - started < 30  # it ended with the trace, not at --run-time
    records = sorted(read_requests(f"{prefix}_requests.csv"), key=lambda r: r.index)
    assert [r.status for r in records] == [Status.OK] * 5
    offsets = [r.start_time - records[0].start_time for r in records]
    assert all(offset >= 0.5 * i - 0.05 for i, offset in enumerate(offsets))
    assert offsets[-1] < 2.0 + 1.0


# The report -----------------------------------------------------------------------


def _synthetic_run(directory: Path, label: str, rate: float, ttft_ms: float, num: int = 20) -> None:
    log = RequestLog(directory / f"rate-{rate:g}_requests.csv")
    start = 1_000_000.0
    for i in range(num):
        slow = i < num * rate / 10  # more requests miss the TTFT SLO as the load grows
        ttft = ttft_ms * (10 if slow else 1)
        log.write(RequestRecord(index=i, kind="chat", endpoint="/v1/chat/completions", start_time=start + i / rate,
                                status=Status.OK, ttft_ms=ttft, tpot_ms=20.0, e2e_ms=ttft + 200, prompt_tokens=50,
                                max_tokens=11, output_tokens=11, num_chunks=11, itl_ms=(20.0,) * 10))
    log.close()
    RunMeta(label=label, workload="chat", workload_args="", seed=0, model=MODEL, host="", stream=True,
            arrival_rate=rate, arrival_process="poisson", num_users=1, slo_ttft_ms=1000, slo_tpot_ms=50,
            start_time=start, end_time=start + num / rate).write(directory / f"rate-{rate:g}_meta.json")


def test_report_finds_the_operating_point_and_draws_the_plots(tmp_path):
    for rate in (0.5, 1.0, 2.0):
        _synthetic_run(tmp_path / "a", "config a", rate, ttft_ms=150)
        _synthetic_run(tmp_path / "b", "config b", rate, ttft_ms=500)
    runs = load_runs(tmp_path)
    assert len(runs) == 6
    # rate 0.5: 1 of 20 slow (95%), 1.0: 2 of 20 (90%), 2.0: 4 of 20 (80%).
    attainment = {(r.summary.label, r.summary.offered_rps): r.summary.attainment for r in runs}
    assert attainment[("config a", 1.0)] == pytest.approx(0.9) and attainment[("config a", 2.0)] == 0.8
    points = operating_points([r.summary for r in runs])
    assert points["config a"].offered_rps == 1.0
    assert points["config a"].goodput_rps == pytest.approx(18 / 20)
    report = write_report(tmp_path).read_text()
    assert "| config a | 1.00 | 0.90 | 90% |" in report
    assert all((tmp_path / name).stat().st_size > 10_000
               for name in ("latency_cdf.png", "latency_vs_load.png", "goodput_vs_load.png"))


@pytest.mark.parametrize("ttft_ms, e2e_ms, lost", [
    (math.nan, 900.0, False),   # waiting, still within the TTFT SLO
    (math.nan, 1100.0, True),   # waiting past it: TTFT will be later still
    (1200.0, 1300.0, True),     # late first token
    (100.0, 100.0 + 9 * 49.0, False),  # decoding; 10 tokens at 49 ms each would still make it
    (100.0, 100.0 + 9 * 51.0, True),   # even 10 tokens cannot bring TPOT under 50 ms any more
])
def test_requests_cut_off_count_against_attainment_only_once_their_slo_is_lost(ttft_ms, e2e_ms, lost):
    record = RequestRecord(index=0, kind="chat", endpoint="/v1/completions", start_time=0.0, status=Status.CUTOFF,
                           ttft_ms=ttft_ms, tpot_ms=math.nan, e2e_ms=e2e_ms, prompt_tokens=0, max_tokens=10,
                           output_tokens=0, num_chunks=0, itl_ms=())
    assert lost_before_cutoff(record, slo_ttft_ms=1000, slo_tpot_ms=50) is lost
    ok = dataclasses.replace(record, status=Status.OK, ttft_ms=100.0, tpot_ms=10.0, e2e_ms=200.0)
    summary = summarize("run", [ok, record], meta=None, slo_ttft_ms=1000, slo_tpot_ms=50)
    assert summary.attainment == (0.5 if lost else 1.0) and summary.num_cutoff == 1


# Locust against the default app -----------------------------------------------------


def test_locust_smoke_against_the_default_app(default_app, tmp_path):
    run_dir = tmp_path / "run"
    done = _locust(default_app.url, run_dir / "locust", "-u", "4", "-r", "4", "--run-time", "10s",
                   "--workload", "mixed", "--max-tokens", "16", timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = read_requests(run_dir / "locust_requests.csv")
    ok = [r for r in records if r.status == Status.OK]
    assert not [r for r in records if r.status == Status.FAILED]
    assert {r.kind for r in ok} == {"chat", "long-short", "short-long"}
    assert all(r.output_tokens == 16 and len(r.itl_ms) == r.num_chunks - 1 for r in ok)
    stats = _stats(run_dir / "locust")
    assert sum(int(row["Failure Count"]) for row in stats.values()) == 0
    assert sum(int(row["Request Count"]) for (kind, _), row in stats.items() if kind == "E2E") == len(ok)

    report = subprocess.run([sys.executable, "-m", "loadtest.report", str(run_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "TTFT p50" in (run_dir / "report.md").read_text()
    assert list(run_dir.glob("*.png"))
    [run] = json.loads((run_dir / "summary.json").read_text())["runs"]
    ttft = run["ttft_ms"]
    assert all(math.isfinite(ttft[p]) and ttft[p] > 0 for p in ("p50", "p90", "p99"))
    assert run["num_ok"] == len(ok) and run["num_failed"] == 0
