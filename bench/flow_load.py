"""What bench.flow_control's clients saw, and what the app's own counters and timelines say of it.

``Load`` sends a trace open-loop with the project's load-test client and
samples the ingress's flow counters meanwhile; ``as_run`` hands what the
clients saw to ``sim.flow_report`` as a replay; the rest reads sheds,
Retry-After against the drain seen, and where the time went
(``/debug/requests``).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from loadtest import client
from pd.config.flow_control import FlowControlArgs
from sim.flow import INTERACTIVE_DEADLINE_S, TENANTS
from sim.flow_trace import FlowArrival, FlowRun
from sim.replica import RequestRecord

SAMPLE_S = 0.25  # how often the ingress's flow counters are sampled
KEYS = {tenant: f"sk-bench-{tenant}" for tenant in TENANTS}


@dataclass
class Served:
    """One request as its client saw it, on the bench's monotonic clock."""

    sent_s: float
    result: client.StreamResult
    status: int | None = None  # None: no answer came
    retry_after_s: float | None = None
    request_id: str | None = None
    done_s: float = math.nan


@dataclass
class Load:
    """Sends a trace open-loop; samples the ingress's flow counters meanwhile."""

    url: str
    model: str
    served: dict[str, Served] = field(default_factory=dict)
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, dispatched tokens)
    states: list[tuple[int, int, int | None]] = field(default_factory=list)  # (waiting, in flight, limit)

    def run(self, arrivals: list[FlowArrival], drain_s: float = 120.0) -> float:
        """Send every arrival at its time; wait for all; the start on the bench's clock."""
        start = time.monotonic()
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample, args=(stop,), daemon=True)
        sampler.start()
        with ThreadPoolExecutor(max_workers=1024) as pool:
            for arrival in arrivals:
                delay = start + arrival.time_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # the open loop's schedule, not synchronisation
                pool.submit(self._send, arrival)
        stop.set()
        sampler.join(drain_s)
        return start

    def _send(self, arrival: FlowArrival) -> None:
        body = {"model": self.model, "prompt": list(arrival.prompt), "max_tokens": arrival.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
                "priority": arrival.priority}
        options = client.RequestOptions(self.model, api_key=KEYS[arrival.tenant], timeout_s=600)
        served = Served(time.monotonic(), client.StreamResult(start_time=time.time()))
        self.served[arrival.request_id] = served
        with requests.Session() as session:
            client.send(session, self.url, client.COMPLETIONS_PATH, body, options, served.result)
        served.done_s = time.monotonic()
        served.status = served.result.status_code
        served.retry_after_s = served.result.retry_after_s
        served.request_id = served.result.request_id

    def _sample(self, stop: threading.Event) -> None:
        while not stop.wait(SAMPLE_S):
            flow = ingress_stats()["flow"]
            if flow is not None:
                self.samples.append((time.monotonic(), flow["dispatched_tokens"]))
                self.states.append((flow["waiting"], flow["in_flight"], flow["limit"]))

    def controller(self) -> dict:
        """What the ingress's controller held over the run: its queue, requests in flight and their limit."""
        if not self.states:
            return {}
        waiting, in_flight, limits = zip(*self.states)
        limits = sorted(limit for limit in limits if limit is not None)
        return {"waiting_max": max(waiting), "in_flight_p50": sorted(in_flight)[len(in_flight) // 2],
                "in_flight_max": max(in_flight), "limit_p50": limits[len(limits) // 2] if limits else None,
                "limit_max": limits[-1] if limits else None}


def pool_counters() -> dict:
    """Each pool's preemptions and local recomputes so far (where overload turns into wasted work)."""
    from ray import serve

    out = {}
    for name in ("PrefillServer", "DecodeServer"):
        stats = serve.get_deployment_handle(name, app_name="pd").stats.remote().result()
        out[name] = {key: stats[key] for key in ("num_preemptions", "num_recompute_fallbacks", "num_running",
                                                 "num_computed_prompt_tokens", "num_prompt_tokens")}
    return out


def ingress_stats() -> dict:
    from ray import serve

    return serve.get_app_handle("pd").process_stats.remote().result()


def as_run(arrivals: list[FlowArrival], load: Load, start_s: float, flow: dict | None) -> FlowRun:
    """What the clients saw, as ``sim.flow_report`` reads a replay: records on the trace's clock, and sheds."""
    records, outcomes = {}, {}
    for arrival in arrivals:
        served = load.served[arrival.request_id]
        record = RequestRecord(arrival.time_s, len(arrival.prompt))
        result = served.result
        if result.error is None:
            first = served.sent_s - start_s + result.ttft_s
            record.token_times_s = [first] + [first + sum(result.itl_s[:i + 1]) for i in range(len(result.itl_s))]
            record.finished_s = served.done_s - start_s
        records[arrival.request_id] = record
        if served.status == 429:
            outcomes[arrival.request_id] = _ShedOutcome(served)
    config = FlowControlArgs(**flow).config() if flow is not None else None
    return FlowRun(arrivals, records, _Gate(outcomes) if flow is not None else None, None,
                   max(s.done_s for s in load.served.values()) - start_s, config)


class _Gate:
    def __init__(self, outcomes: dict) -> None:
        self.outcomes = outcomes


class _ShedOutcome:
    """A 429 as ``sim.flow_report`` counts a shed: by the reason its body named."""

    def __init__(self, served: Served) -> None:
        from router.flow_control import ShedReason

        reason = (served.result.error_code or "queue_full")
        self.shed = type("Shed", (), {"reason": ShedReason(reason)})()


def shed_figures(arrivals: list[FlowArrival], load: Load, no_shed: FlowRun) -> dict:
    """How soon 429s came (per reason), whether the deadline sheds would have missed without shedding, and
    Retry-After against the drain seen."""
    sheds = [(arrival, load.served[arrival.request_id]) for arrival in arrivals
             if load.served[arrival.request_id].status == 429]
    count: dict[str, int] = {}
    fast: dict[str, int] = {}
    for _, served in sheds:
        reason = served.result.error_code or "unknown"
        count[reason] = count.get(reason, 0) + 1
        fast[reason] = fast.get(reason, 0) + (served.result.e2e_s <= 0.05)
    deadline = [arrival for arrival, served in sheds if served.result.error_code in ("deadline", "expired")]
    missed = sum(not (record := no_shed.records[arrival.request_id]).token_times_s
                 or record.ttft_s > INTERACTIVE_DEADLINE_S for arrival in deadline)
    answers = sorted(served.result.e2e_s for _, served in sheds)
    return {"shed": len(sheds), "by_reason": count,
            "within_50ms": round(sum(fast.values()) / len(sheds), 3) if sheds else None,
            "within_50ms_by_reason": {reason: round(fast[reason] / count[reason], 3) for reason in sorted(count)},
            "answer_ms_p50": round(answers[len(answers) // 2] * 1000, 1) if answers else None,
            "deadline_shed": len(deadline), "would_have_missed": round(missed / len(deadline), 3) if deadline else None,
            "retry_after": drain_check(sheds, load)}


def drain_check(sheds: list[tuple[FlowArrival, Served]], load: Load, most: int = 300) -> dict:
    """Each shed's predicted queue drain (its timeline's ``queue_drain_s``) against the drain seen: the time
    until the ingress had dispatched the tokens that were ahead of it (``tokens_ahead``)."""
    times = [t for t, _ in load.samples]
    totals = [tokens for _, tokens in load.samples]
    ratios, unknown = [], 0
    with requests.Session() as session:
        for _, served in sheds[:most]:
            timeline = session.get(f"{load.url}/debug/requests/{served.request_id}",
                                   headers={"Authorization": f"Bearer {KEYS['a']}"}).json()
            attributes = timeline.get("attributes", {})
            ahead, predicted = attributes.get("tokens_ahead"), attributes.get("queue_drain_s")
            if not ahead:
                continue
            if predicted is None:
                unknown += 1
                continue
            at = served.done_s
            start = next((i for i, t in enumerate(times) if t >= at), len(times))
            if start == len(times):
                continue
            done = next((i for i in range(start, len(times)) if totals[i] - totals[start] >= ahead), None)
            actual = times[done] - at if done is not None else math.inf
            ratios.append(predicted / actual if actual > 0 else math.inf)
    within = sum(0.5 <= ratio <= 2.0 for ratio in ratios)
    return {"checked": len(ratios), "no_rate_yet": unknown,
            "within_2x": round(within / len(ratios), 3) if ratios else None,
            "median_ratio": round(sorted(ratios)[len(ratios) // 2], 3) if ratios else None}


def span_medians(trace: list[FlowArrival], load: Load, interactive: bool = True, most: int = 200) -> dict:
    """Where the band's served requests spent their time before their first token: each timeline span's
    median and p90 seconds (``/debug/requests``), over at most ``most`` of them. The decode call itself lasts
    the whole stream and is left out; its engine's intervals (``decode.queue``, ``decode.compute``: a local
    prefill, ``decode.kv_pull``) end at the first token and are kept."""
    durations: dict[str, list[float]] = {}
    with requests.Session() as session:
        for arrival in [a for a in trace if a.interactive == interactive][:most]:
            served = load.served[arrival.request_id]
            if served.status != 200 or served.request_id is None:
                continue
            timeline = session.get(f"{load.url}/debug/requests/{served.request_id}",
                                   headers={"Authorization": f"Bearer {KEYS['a']}"}).json()
            for span in timeline.get("spans", []):
                if span.get("duration_s") is not None and span["name"] != "decode":
                    durations.setdefault(span["name"], []).append(span["duration_s"])
    return {name: {"p50": round(sorted(v)[len(v) // 2], 3), "p90": round(sorted(v)[int(0.9 * (len(v) - 1))], 3),
                   "n": len(v)} for name, v in sorted(durations.items())}
