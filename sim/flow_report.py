"""What a flow-control replay shows, per tenant and band: offered, served, shed, TTFT, goodput, fairness.

Counted over a window of the trace (``window``: from ``start_s``, past the
start-up, to the trace's end), each request by its arrival, except served
tokens for fairness, which count by the time its first token came (the
share each tenant got while they competed; requests served after the
trace ended, when nothing competes, are left out).

- ``served``: requests that finished; ``tokens`` prompt + output.
- ``goodput_rps``: served requests that met their TTFT deadline (none: any)
  and ``slo_tpot_s``, per second of the window.
- ``missed``: served requests whose TTFT passed their deadline (a client
  waiting that long would have timed out).
- Jain's index, ``(sum x)^2 / (n sum x^2)``, over ``x`` = a tenant's served
  tokens over its weight, among the tenants *backlogged* (any of their
  requests shed, or less than 90% of the tokens they offered served):
  per band, and over the bands together; and ``jain_max_min`` over every
  tenant's served tokens over its max-min fair share of what was served
  (water-filling by weight, each capped at what it offered).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from pd.workload.stats import percentile
from sim.flow_trace import FlowArrival, FlowRun

DEFAULT_SLO_TPOT_S = 0.1


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    def holds(self, time_s: float | None) -> bool:
        return time_s is not None and self.start_s <= time_s < self.end_s


def jain(values: list[float]) -> float | None:
    """Jain's fairness index of ``values``: 1 when equal, 1/n when one has everything; None for none."""
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(value * value for value in values))


def max_min_shares(offered: dict[str, float], weights: dict[str, float], total: float) -> dict[str, float]:
    """``total`` split by weight, none given more than it offered, the rest to those that want more."""
    shares = {name: 0.0 for name in offered}
    wanting = {name for name in offered if offered[name] > 0}
    left = total
    while wanting and left > 1e-9:
        weight = sum(weights[name] for name in wanting)
        step = {name: left * weights[name] / weight for name in wanting}
        capped = {name for name in wanting if shares[name] + step[name] >= offered[name]}
        if not capped:
            for name in wanting:
                shares[name] += step[name]
            break
        for name in capped:
            left -= offered[name] - shares[name]
            shares[name] = offered[name]
        wanting -= capped
    return shares


def request_band(run: FlowRun, arrival: FlowArrival) -> str:
    """The band its priority names (the flow config's; interactive/batch without one)."""
    if run.flow is None:
        return "interactive" if arrival.interactive else "batch"
    return run.flow.bands[run.flow.band_index(arrival.priority)].name


def deadline_s(run: FlowRun, arrival: FlowArrival, default_s: float | None) -> float | None:
    if run.flow is None:
        return default_s if arrival.interactive else None
    return run.flow.bands[run.flow.band_index(arrival.priority)].ttft_deadline_s


def summarize(run: FlowRun, window: Window, interactive_deadline_s: float | None = 2.0,
              slo_tpot_s: float = DEFAULT_SLO_TPOT_S) -> dict:
    """The run's figures (module docstring): ``tenants``, ``bands``, each ``tenant/band``, and fairness."""
    groups: dict[str, _Group] = {}
    for arrival in run.arrivals:
        if not window.holds(arrival.time_s):
            continue
        band = request_band(run, arrival)
        for key in (f"tenant:{arrival.tenant}", f"band:{band}", f"{arrival.tenant}/{band}", "all"):
            groups.setdefault(key, _Group()).add(run, arrival, deadline_s(run, arrival, interactive_deadline_s),
                                                  slo_tpot_s)
    figures = {key: group.figures(window.span_s) for key, group in sorted(groups.items())}
    return {"groups": figures, "fairness": fairness(run, window)}


def fairness(run: FlowRun, window: Window) -> dict:
    weights = {tenant.name: tenant.weight for tenant in run.flow.tenants} if run.flow else {}
    served: Counter[tuple[str, str]] = Counter()
    offered: Counter[tuple[str, str]] = Counter()
    backlogged: set[tuple[str, str]] = set()
    for arrival in run.arrivals:
        key = (arrival.tenant, request_band(run, arrival))
        record = run.records[arrival.request_id]
        if window.holds(arrival.time_s):
            offered[key] += arrival.cost
            if _shed(run, arrival) is not None:
                backlogged.add(key)
        if record.finished_s is not None and window.holds(record.token_times_s[0]):
            served[key] += len(arrival.prompt) + len(record.token_times_s)
    backlogged |= {key for key in offered if served[key] < 0.9 * offered[key]}
    tenants = sorted({tenant for tenant, _ in offered})
    bands = sorted({band for _, band in offered})

    def weighted(tenant: str, tokens: float) -> float:
        return tokens / weights.get(tenant, 1.0)

    per_band = {band: jain([weighted(t, served[t, band]) for t in tenants if (t, band) in backlogged])
                for band in bands}
    total = {t: sum(served[t, band] for band in bands) for t in tenants}
    total_offered = {t: sum(offered[t, band] for band in bands) for t in tenants}
    shares = max_min_shares(total_offered, {t: weights.get(t, 1.0) for t in tenants}, sum(total.values()))
    return {
        "served_tokens": total,
        "served_share": {t: round(total[t] / max(1, sum(total.values())), 3) for t in tenants},
        "backlogged": sorted(f"{t}/{band}" for t, band in backlogged),
        "jain_per_band": per_band,
        "jain_backlogged": jain([weighted(t, total[t]) for t in tenants if any((t, b) in backlogged for b in bands)]),
        "jain_max_min": jain([total[t] / shares[t] for t in tenants if shares[t] > 0]),
    }


def _shed(run: FlowRun, arrival: FlowArrival):
    if run.gate is None:
        return None
    outcome = run.gate.outcomes.get(arrival.request_id)
    return None if outcome is None else outcome.shed


class _Group:
    def __init__(self) -> None:
        self.num_offered = self.offered_tokens = self.num_served = self.served_tokens = 0
        self.num_good = self.num_missed = self.num_waited = 0
        self.shed: Counter[str] = Counter()
        self.ttfts: list[float] = []
        self.waits: list[float] = []

    def add(self, run: FlowRun, arrival: FlowArrival, deadline: float | None, slo_tpot_s: float) -> None:
        record = run.records[arrival.request_id]
        self.num_offered += 1
        self.offered_tokens += arrival.cost
        shed = _shed(run, arrival)
        if shed is not None:
            self.shed[shed.reason.value] += 1
        if record.finished_s is None:
            return
        self.num_served += 1
        self.served_tokens += len(arrival.prompt) + len(record.token_times_s)
        self.ttfts.append(record.ttft_s)
        late = deadline is not None and record.ttft_s > deadline
        self.num_missed += late
        tpot = (record.e2e_s - record.ttft_s) / (len(record.token_times_s) - 1) if len(record.token_times_s) > 1 else 0
        self.num_good += not late and tpot <= slo_tpot_s

    def figures(self, span_s: float) -> dict:
        return {
            "offered": self.num_offered, "offered_tokens": self.offered_tokens,
            "served": self.num_served, "served_tokens": self.served_tokens,
            "shed": sum(self.shed.values()), "shed_by_reason": dict(sorted(self.shed.items())),
            "ttft_p50_s": _rounded(percentile(self.ttfts, 50)) if self.ttfts else None,
            "ttft_p99_s": _rounded(percentile(self.ttfts, 99)) if self.ttfts else None,
            "goodput_rps": round(self.num_good / span_s, 3),
            "missed_deadline": self.num_missed,
        }


def _rounded(value: float) -> float:
    return round(value, 4) if math.isfinite(value) else value
