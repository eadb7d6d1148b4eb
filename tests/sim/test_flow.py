"""Flow control in simulated time: the ingress's own FlowController before a simulated P/D deployment."""

from __future__ import annotations

import dataclasses

import pytest

from pd.sampling_params import SamplingParams
from router.flow_config import FlowIdentity
from router.flow_control import FlowController, ShedReason
from sim.clock import EventLoop
from sim.cluster import SimCluster
from sim.flow import default_flow, default_spec, drain_check
from sim.flow_gate import FlowGate
from sim.flow_plot import BIN_S, interactive_ttft_p99, plot, served_tokens_per_s
from sim.flow_report import Window, jain, max_min_shares, summarize
from sim.flow_trace import FlowTraceConfig, generate, replay

# The default deployment finishes about 35 requests a second (python -m sim.flow's capacity sweep): this is 2x.
OVERLOAD = FlowTraceConfig(rate_rps=70.0, duration_s=20.0, seed=1)
WINDOW = Window(5.0, 20.0)


@pytest.fixture(scope="module")
def overload():
    spec, trace = default_spec(), generate(OVERLOAD)
    return replay(spec, trace, default_flow()), replay(spec, trace)


def test_under_overload_the_interactive_band_keeps_its_deadline_and_batch_is_shared_fairly(overload):
    flow, plain = overload
    groups = summarize(flow, WINDOW)
    interactive, batch = groups["groups"]["band:interactive"], groups["groups"]["band:batch"]
    assert interactive["shed"] == 0 and interactive["missed_deadline"] == 0
    assert interactive["ttft_p99_s"] < 2.0
    assert summarize(plain, WINDOW)["groups"]["band:interactive"]["ttft_p99_s"] > 10.0  # what it would have been
    assert batch["shed"] > 100 and set(batch["shed_by_reason"]) <= {"tenant_queue", "displaced"}
    fairness = groups["fairness"]
    assert set(fairness["backlogged"]) == {"a/batch", "b/batch", "c/batch"}
    assert fairness["jain_per_band"]["batch"] > 0.95  # c sends 70%, and gets a third of the batch band
    assert fairness["served_share"]["c"] < 0.6


def test_shed_requests_cost_no_compute_and_retry_after_matches_the_drain(overload):
    flow, _ = overload
    outcomes = flow.gate.outcomes.values()
    shed = [outcome for outcome in outcomes if outcome.shed is not None]
    admitted = [outcome for outcome in outcomes if outcome.admit is not None]
    assert len(shed) + len(admitted) == len(flow.arrivals)
    assert all(not flow.records[outcome.request.request_id].token_times_s for outcome in shed)
    # Every admitted request, and nothing else, reached the decode pool (once: P/D's second call).
    assert sum(flow.cluster.decode.num_routed.values()) == len(admitted)
    assert all(outcome.decided_s == outcome.request.arrival_s for outcome in shed
               if outcome.shed.reason is ShedReason.TENANT_QUEUE)  # answered on arrival
    drain = drain_check(flow)
    assert drain["checked"] > 100 and drain["within_2x"] > 0.9


def test_the_plot_reads_the_runs_it_draws(overload, tmp_path):
    flow, plain = overload
    windows = interactive_ttft_p99(flow)
    assert [middle for middle, _ in windows] == [2.5 + 5.0 * n for n in range(len(windows))]
    assert max(p99 for middle, p99 in windows if middle > 5.0) < 2.0  # the deadline held, window by window
    assert max(p99 for _, p99 in interactive_ttft_p99(plain)) > 10.0
    for tenant in ("a", "b", "c"):
        tokens = sum(rate * BIN_S for _, rate in served_tokens_per_s(flow, tenant))
        assert tokens == sum(len(a.prompt) + len(flow.records[a.request_id].token_times_s) for a in flow.arrivals
                             if a.tenant == tenant and flow.records[a.request_id].token_times_s)
    out = tmp_path / "flow.png"
    plot({"flow_control": flow, "no_flow_control": plain}, flow, 1_000.0, 10.0, 2.0, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_replay_is_deterministic():
    spec, trace = default_spec(), generate(dataclasses.replace(OVERLOAD, duration_s=4.0))
    first, second = replay(spec, trace, default_flow()), replay(spec, trace, default_flow())
    assert summarize(first, Window(0.0, 4.0)) == summarize(second, Window(0.0, 4.0))
    assert ({rid: (o.shed and o.shed.reason, o.decided_s) for rid, o in first.gate.outcomes.items()}
            == {rid: (o.shed and o.shed.reason, o.decided_s) for rid, o in second.gate.outcomes.items()})
    assert any(o.decided_s > o.request.arrival_s for o in first.gate.outcomes.values())  # some waited


def test_over_quota_traffic_borrows_what_nobody_else_wants():
    trace = generate(FlowTraceConfig(rate_rps=40.0, duration_s=12.0, seed=3, tenant_shares=(("c", 1.0),)))
    run = replay(default_spec(), trace, default_flow(quota_c_tokens_per_min=60_000))  # 1,000 tokens a second
    counters = run.gate.controller.counters
    assert counters.borrowed["c"] > 0.5 * sum(counters.admitted.values())
    served = summarize(run, Window(2.0, 12.0))["groups"]["tenant:c"]["served_tokens"]
    assert served > 5 * 1_000 * 10  # many times its quota: the capacity was idle


def test_a_request_flow_control_cannot_classify_is_refused_before_any_compute():
    spec = default_spec()
    trace = generate(FlowTraceConfig(rate_rps=5.0, duration_s=1.0, seed=0))
    config = dataclasses.replace(default_flow(), trust_tenant_header=True)
    loop = EventLoop()
    cluster = SimCluster(loop, spec)
    gate = FlowGate(loop, FlowController(config)).attach(cluster)
    arrival = trace[0]
    cluster.submit("stranger", list(arrival.prompt), SamplingParams(max_tokens=4, ignore_eos=True),
                   identity=FlowIdentity(tenant_header="zed"))
    cluster.submit("known", list(arrival.prompt), SamplingParams(max_tokens=4, ignore_eos=True),
                   identity=FlowIdentity(tenant_header="b"))
    loop.run()
    assert gate.outcomes["stranger"].error == "x-tenant-id: unknown tenant 'zed'"
    assert not cluster.records["stranger"].token_times_s
    assert len(cluster.records["known"].token_times_s) == 4 and gate.outcomes["known"].admit.request.tenant == "b"


def test_fairness_figures_have_known_answers():
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([]) is None
    shares = max_min_shares({"a": 30.0, "b": 30.0, "c": 140.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, 100.0)
    assert shares == pytest.approx({"a": 30.0, "b": 30.0, "c": 40.0})  # c gets the remainder, not the whole
    shares = max_min_shares({"a": 100.0, "b": 100.0}, {"a": 2.0, "b": 1.0}, 90.0)
    assert shares == pytest.approx({"a": 60.0, "b": 30.0})
