"""The simulator runs the engine's own speculator: on an H200-priced Llama-3-8B replica, drafts pay at low
load, and at saturation with poor drafts the back-off keeps throughput, where speculating regardless loses it."""

from __future__ import annotations

import pytest

from pd.config import EngineConfig
from pd.model.config import load_model_config
from sim.engine import DraftModel
from sim.hardware import HARDWARE, analytic_cost, kv_cache_bytes, model_dir
from sim.spec import compare, poisson_trace


@pytest.fixture(scope="module")
def replica():
    path = model_dir("llama-3-8b")
    model, gpu = load_model_config(path), HARDWARE["h200"]
    config = EngineConfig(model=path, kv_cache_bytes=kv_cache_bytes(model, gpu), max_model_len=2048)
    return config, analytic_cost(model, gpu)


def _compare(replica, rate: float, num_requests: int, acceptance: float, backoff: bool = True) -> dict:
    config, cost = replica
    return compare(config, cost, DraftModel(found=1.0, acceptance=acceptance),
                   {"method": "ngram", "num_speculative_tokens": 4, "backoff": backoff},
                   poisson_trace(rate, num_requests, 1024, 128, seed=0))


def test_drafts_pay_at_low_load_and_the_back_off_keeps_throughput_at_saturation(replica):
    low = _compare(replica, rate=1, num_requests=40, acceptance=0.7)
    assert low["pays"] and low["tpot_p50_ratio"] > 2.0  # a bandwidth-bound step verifies 4 drafts for free
    assert low["spec"]["mean_accepted"] > 1.5
    saturated = _compare(replica, rate=256, num_requests=150, acceptance=0.2)
    assert saturated["throughput_ratio"] >= 0.97
    regardless = _compare(replica, rate=256, num_requests=150, acceptance=0.2, backoff=False)
    assert regardless["throughput_ratio"] < 0.9  # what the back-off saves
