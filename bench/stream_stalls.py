"""What one client's heavy request costs everyone else's streams, against a running app.

``python -m bench.stream_stalls [--url http://127.0.0.1:8000] [--cases echo_max,best_of,...]`` runs
``--streams`` (3) streaming completions on the app (``serve run serve_configs/default.yaml``, say) and,
once they stream, sends one case's requests; when those are answered it stops the streams. Each case
prints one JSON line:

- ``worst_gap_s``: the longest gap between two chunks of any stream while the case's requests ran (from
  their sending to a second after the last answer); ``quiet_gap_s``: the same streams' longest gap
  before them; the goal (issue 60) is ``worst_gap_s`` ≤ 0.5 s;
- ``statuses``, ``seconds``: the case's answers and how long the last took;
- ``stalls``: each gap over 0.5 s, as [seconds after sending, gap], beside ``answered_at_s``;
- ``median_gap_s`` and ``quiet_median_gap_s``: the streams' median gap while the case ran and before it (what
  decode pays for the host it shares with the prefill replica);
- the CPU and its ISA flags.

Cases (``--prompt-tokens`` sets the long prompts, by default the model's ``max_model_len`` less one for the
``echo_max`` cases, else 1,550):

- ``echo_max``: ``max_tokens: 0``, ``echo``, ``logprobs: 20`` over a prompt of max_model_len - 1 tokens;
- ``prompt_logprobs``: vLLM's ``prompt_logprobs: 20`` (the offline ``SamplingParams`` field, served as an extension)
  with one token generated, over a prompt of max_model_len - 1 tokens;
- ``echo_max_burst``: 8 ``echo_max`` requests at once;
- ``best_of``: ``best_of: 8``, ``logprobs: 5``, 64 tokens over a 1,550-token prompt;
- ``echo_burst``: 8 echo requests at once, ``logprobs: 20``, 1,550-token prompts;
- ``local_burst``: 8 prompts of about 240 tokens at once, each its own (under
  ``remote_prefill_threshold``: they prefill on the decode replica, beside the streams).

Prompts are words the model's tokenizer reads as one token each (``hello``), numbered where a prompt
must be its own.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import string
import threading
import time
import urllib.parse

from pd.workload.host import cpu_flags, cpu_name

MODEL = "builtin:smollm2-135m-instruct"
CASES = ("echo_max", "prompt_logprobs", "best_of", "echo_burst", "local_burst", "echo_max_burst")
AT_MAX_LEN = ("echo_max", "prompt_logprobs", "echo_max_burst")
MAX_MODEL_LEN = 8192  # the default model's
STREAM_TOKENS = 1000  # each streamed completion's length (``Streams``)


def _post(url: str, body: dict, timeout_s: float = 900.0) -> int:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class Streams:
    """``n`` streams, each streaming completions of ``STREAM_TOKENS`` one after another until ``stop``.

    Each completion's chunk arrival times are kept (``arrivals``, one list per completion), and whether it
    still streams (``open``): a completion starved when the window ends has a gap that has not ended, which
    counts. Bounded completions keep the streams' KV well within a decode replica's pool for any run's length:
    three 8,000-token streams outgrow the default app's 11,648 tokens after some minutes, and the preemptions
    that follow are the streams' own, not the case's.
    """

    def __init__(self, url: str, n: int):
        self.url, self.stop = url, threading.Event()
        self.arrivals: list[list[float]] = []
        self.open: list[bool] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        self._lock = threading.Lock()

    def __enter__(self) -> Streams:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, index: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {index}: once upon a time", "max_tokens": STREAM_TOKENS,
                "ignore_eos": True, "stream": True, "temperature": 0}
        parts = urllib.parse.urlsplit(self.url)
        while not self.stop.is_set():
            with self._lock:
                times, slot = [], len(self.open)
                self.arrivals.append(times)
                self.open.append(True)
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
            try:
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                response = conn.getresponse()
                while not self.stop.is_set():
                    line = response.readline()
                    if not line or line.startswith(b"data: [DONE]"):
                        self.open[slot] = False
                        break
                    if line.startswith(b"data: "):
                        times.append(time.monotonic())
            finally:
                conn.close()

    def gaps(self, start: float, end: float) -> list[float]:
        """The gaps between two chunks of any completion that ended in ``[start, end]``, and at ``end`` the gap
        since the last chunk of each completion still streaming then."""
        ended = [b - a for times in self.arrivals for a, b in zip(times, times[1:]) if start <= b <= end]
        waiting = [end - times[-1] for times, streaming in zip(self.arrivals, self.open)
                   if streaming and times and times[-1] <= end]
        return ended + waiting

    def worst_gap(self, start: float, end: float) -> float:
        return max(self.gaps(start, end), default=0.0)

    def stalls(self, start: float, end: float, over_s: float = 0.5) -> list[list[float]]:
        """Each gap over ``over_s`` that ended in ``[start, end]``: when it ended (seconds after ``start``), and
        how long it was, to set beside the answers' times."""
        return sorted([round(b - start, 2), round(b - a, 3)] for times in self.arrivals
                      for a, b in zip(times, times[1:]) if start <= b <= end and b - a > over_s)

    def median_gap(self, start: float, end: float) -> float:
        """What the streams pay for sharing the host while the case runs, against their quiet median."""
        return statistics.median(self.gaps(start, end) or [0.0])


def case_bodies(case: str, prompt_tokens: int | None) -> list[dict]:
    long_len = prompt_tokens or (MAX_MODEL_LEN - 1 if case in AT_MAX_LEN else 1550)
    long_prompt = " ".join(["hello"] * long_len)
    echo = {"model": MODEL, "prompt": long_prompt, "max_tokens": 0, "echo": True, "logprobs": 20}
    if case == "echo_max":
        return [echo]
    if case == "prompt_logprobs":
        return [{"model": MODEL, "prompt": long_prompt, "max_tokens": 1, "prompt_logprobs": 20}]
    if case == "echo_max_burst":
        return [echo] * 8
    if case == "best_of":
        return [{"model": MODEL, "prompt": long_prompt, "max_tokens": 64, "best_of": 8, "logprobs": 5}]
    if case == "echo_burst":
        return [echo] * 8
    if case == "local_burst":
        salt = "".join(random.choice(string.ascii_lowercase) for _ in range(2))  # nothing cached from a run before
        return [{"model": MODEL, "prompt": " ".join(f"{salt}{k}x{j}" for j in range(44)), "max_tokens": 4}
                for k in range(8)]
    raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def run_case(url: str, case: str, num_streams: int, prompt_tokens: int | None, warm_s: float) -> dict:
    bodies = case_bodies(case, prompt_tokens)
    statuses: list[int | str] = [0] * len(bodies)

    done: list[float] = []

    def send(k: int) -> None:
        try:
            statuses[k] = _post(url, bodies[k])
        except OSError as exc:
            statuses[k] = type(exc).__name__
        done.append(time.monotonic())

    with Streams(url, num_streams) as streams:
        time.sleep(warm_s)  # the streams' own first tokens and a quiet stretch to compare with
        quiet_from, sent = time.monotonic() - warm_s / 2, time.monotonic()
        senders = [threading.Thread(target=send, args=(k,)) for k in range(len(bodies))]
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join()
        answered = time.monotonic()
        time.sleep(1.0)
    return {"case": case, "streams": num_streams, "requests": len(bodies), "statuses": statuses,
            "seconds": round(answered - sent, 2), "worst_gap_s": round(streams.worst_gap(sent, answered + 1.0), 3),
            "quiet_gap_s": round(streams.worst_gap(quiet_from, sent), 3),
            "median_gap_s": round(streams.median_gap(sent, answered), 4),
            "quiet_median_gap_s": round(streams.median_gap(quiet_from, sent), 4),
            "stalls": streams.stalls(sent, answered + 1.0), "answered_at_s": sorted(round(t - sent, 2) for t in done),
            "cpu": cpu_name(), "isa": cpu_flags()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--warm-s", type=float, default=4.0)
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        print(json.dumps(run_case(args.url, case, args.streams, args.prompt_tokens, args.warm_s)), flush=True)


if __name__ == "__main__":
    main()
