"""Replicas and the ingress on one machine's cores (``sim.host``)."""

from __future__ import annotations

import pytest

from pd.sampling_params import SamplingParams
from sim.clock import EventLoop
from sim.cluster import SimCluster
from sim.host import HostModel, SharedHost
from tests.sim.test_cluster import prompts, spec

INGRESS_S = 0.05


def test_demand_is_the_steps_the_ingress_work_and_the_tokens_streamed():
    loop = EventLoop()
    host = SharedHost(loop, HostModel(cores=2, cpu_per_token_s=0.01))
    assert host.begin("decode-0", 2) == 1.0
    assert host.begin("ingress:r0", 1) == pytest.approx(1.5)  # the step's two threads and the ingress's one
    host.note_tokens(50)  # half a core over the last second
    assert host.begin("prefill-0", 1) == pytest.approx((2 + 1 + 1 + 0.5) / 2)
    for key in ("decode-0", "ingress:r0", "prefill-0"):
        host.end(key)
    assert host.begin("prefill-0", 1) == 1.0  # 1.5 of demand on two cores


def _first_token_s(arrivals: dict[str, float], cores: float) -> dict[str, float]:
    """Each request's TTFT on one colocated replica whose host has ``cores``, every prompt 512 tokens."""
    loop = EventLoop()
    cluster = SimCluster(loop, spec(num_prefill=0, num_decode=1, ingress_s=INGRESS_S,
                                    host=HostModel(cores=cores, cpu_per_token_s=0.0)))
    prompt = {request_id: tokens for request_id, tokens in zip(arrivals, prompts(len(arrivals), lengths=(512,)))}
    for request_id, at_s in arrivals.items():
        loop.at(at_s, lambda request_id=request_id: cluster.submit(
            request_id, prompt[request_id], SamplingParams(max_tokens=2, ignore_eos=True)))
    loop.run()
    return {request_id: record.ttft_s for request_id, record in cluster.records.items()}


def test_the_ingress_work_on_a_request_takes_the_cores_the_engines_share():
    alone = _first_token_s({"r0": 0.0}, cores=1)["r0"]
    assert alone > INGRESS_S

    # Two requests' ingress work at once on one core: each takes twice as long.
    together = _first_token_s({"r0": 0.0, "r1": 0.0}, cores=1)
    assert min(together.values()) >= 2 * INGRESS_S
    assert _first_token_s({"r0": 0.0, "r1": 0.0}, cores=2)["r0"] == pytest.approx(alone)

    # r0's prefill starts while r1's ingress work runs, and is slower for it.
    overlapped = _first_token_s({"r0": 0.0, "r1": 0.9 * INGRESS_S}, cores=1)["r0"]
    assert overlapped > alone + 0.5 * (alone - INGRESS_S)
