"""Tenants' traffic for flow control in simulated time: a seeded trace, and its replay through a deployment.

A trace is Poisson arrivals at ``rate_rps``; each request's tenant is drawn
by ``tenant_shares`` (only among the tenants active at its time,
``active``), its band by ``interactive_share`` (priority 0, else 1), its
prompt of random tokens (no prefix shared) and its output length from the
choices given. ``replay`` serves it on a ``SimCluster`` with the app's
routers (the prefill pool's predicted-latency one, whose predictions flow
control reads) behind a ``FlowGate`` when a ``FlowConfig`` is given, and
without flow control otherwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pd.sampling_params import SamplingParams
from router.flow_config import FlowConfig, FlowIdentity
from router.flow_control import FlowController
from router.latency import LatencyPolicyConfig
from sim.clock import EventLoop
from sim.cluster import ClusterSpec, SimCluster
from sim.flow_gate import FlowGate
from sim.placement import LatencyPlacement
from sim.replica import RequestRecord

INTERACTIVE_PRIORITY = 0
BATCH_PRIORITY = 1


@dataclass(frozen=True)
class FlowTraceConfig:
    rate_rps: float
    duration_s: float
    tenant_shares: tuple[tuple[str, float], ...] = (("a", 0.15), ("b", 0.15), ("c", 0.70))
    interactive_share: float = 0.3
    prompt_lengths: tuple[int, ...] = (64, 200, 400, 800)
    output_lengths: tuple[int, ...] = (16, 48, 96)
    # Each tenant's active window (start_s, end_s); a tenant not named is active throughout.
    active: tuple[tuple[str, float, float], ...] = ()
    vocab_size: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate_rps > 0 and self.duration_s > 0):
            raise ValueError(f"rate_rps and duration_s must be > 0, got {self.rate_rps} and {self.duration_s}")
        if not 0 <= self.interactive_share <= 1:
            raise ValueError(f"interactive_share must be in [0, 1], got {self.interactive_share}")
        if not self.tenant_shares or min(share for _, share in self.tenant_shares) <= 0:
            raise ValueError("tenant_shares must name tenants, each with a share > 0")

    def active_at(self, tenant: str, time_s: float) -> bool:
        return all(start <= time_s < end for name, start, end in self.active if name == tenant)


@dataclass(frozen=True)
class FlowArrival:
    request_id: str
    time_s: float
    tenant: str
    priority: int
    prompt: tuple[int, ...]
    max_tokens: int

    @property
    def interactive(self) -> bool:
        return self.priority == INTERACTIVE_PRIORITY

    @property
    def cost(self) -> int:
        return len(self.prompt) + self.max_tokens


def generate(config: FlowTraceConfig) -> list[FlowArrival]:
    """The trace's requests, in arrival order (seeded: the same config gives the same trace)."""
    rng = random.Random(config.seed)
    arrivals: list[FlowArrival] = []
    time_s = rng.expovariate(config.rate_rps)
    while time_s < config.duration_s:
        active = [(name, share) for name, share in config.tenant_shares if config.active_at(name, time_s)]
        if active:
            tenant = rng.choices([name for name, _ in active], [share for _, share in active])[0]
            priority = INTERACTIVE_PRIORITY if rng.random() < config.interactive_share else BATCH_PRIORITY
            prompt = tuple(rng.randrange(1, config.vocab_size) for _ in range(rng.choice(config.prompt_lengths)))
            arrivals.append(FlowArrival(f"r{len(arrivals)}", time_s, tenant, priority, prompt,
                                        rng.choice(config.output_lengths)))
        time_s += rng.expovariate(config.rate_rps)
    return arrivals


def api_key(tenant: str) -> str:
    """The key a simulated tenant presents (a FlowConfig for ``replay`` maps it to the tenant)."""
    return f"key-{tenant}"


@dataclass
class FlowRun:
    """One replay: every request's record, and the gate's outcomes where flow control ran."""

    arrivals: list[FlowArrival]
    records: dict[str, RequestRecord]
    gate: FlowGate | None
    cluster: SimCluster
    end_s: float
    flow: FlowConfig | None = None
    busy_s: dict[str, float] = field(default_factory=dict)


def replay(spec: ClusterSpec, arrivals: list[FlowArrival], flow: FlowConfig | None = None) -> FlowRun:
    """Serve ``arrivals`` on a deployment of ``spec``, behind flow control when ``flow`` is given."""
    loop = EventLoop()
    placement = None
    if spec.prefill is not None:
        placement = LatencyPlacement(LatencyPolicyConfig(block_size=spec.block_size, seed=spec.seed,
                                                         max_num_batched_tokens=spec.prefill.engine
                                                         .max_num_batched_tokens, **spec.prefill_policy), loop.time)
    cluster = SimCluster(loop, spec, placement)
    gate = FlowGate(loop, FlowController(flow), spec.report_period_s).attach(cluster) if flow is not None else None
    for arrival in arrivals:
        identity = FlowIdentity(api_key=api_key(arrival.tenant), priority=arrival.priority)
        params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
        loop.at(arrival.time_s, lambda arrival=arrival, identity=identity, params=params: cluster.submit(
            arrival.request_id, list(arrival.prompt), params, identity=identity))
    loop.run()
    return FlowRun(arrivals, cluster.records, gate, cluster, loop.now, flow, cluster.busy_s())
