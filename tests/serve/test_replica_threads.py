"""A replica computes on the CPUs Ray assigned it, rounded up, within the cores it may use; its steps of few
tokens on the CPUs it holds whole."""

from __future__ import annotations

import os

import pytest

from pd.serve import engine_server
from pd.serve.engine_server import replica_decode_threads, replica_threads


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(engine_server, "cgroup_cpu_limit", lambda: None)


@pytest.mark.parametrize(("assigned", "threads"), [(None, 1), (0.25, 1), (1.0, 1), (1.5, 2), (2.0, 2), (16.0, 4)])
def test_assigned_cpus_round_up_to_the_cores_there_are(four_cores, assigned, threads):
    # Ray itself would give 1.5 CPUs one OpenMP thread (the floor).
    assert replica_threads(assigned) == threads


@pytest.mark.parametrize(("assigned", "threads"), [(None, 1), (0.25, 1), (1.0, 1), (1.5, 1), (2.0, 2), (2.5, 2),
                                                   (16.0, 4)])
def test_steps_of_few_tokens_take_the_whole_cpus_only(four_cores, assigned, threads):
    assert replica_decode_threads(assigned) == threads


def test_a_cgroup_quota_caps_the_threads(four_cores, monkeypatch):
    monkeypatch.setattr(engine_server, "cgroup_cpu_limit", lambda: 2.5)
    assert replica_threads(8.0) == 3


def test_an_engine_config_sets_the_threads():
    import torch

    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    before = torch.get_num_threads()
    try:
        LLMEngine(EngineConfig(num_blocks=8, num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)
