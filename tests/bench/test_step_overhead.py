"""``bench.step_overhead``: the real engine's decode steps timed phase by phase, both modes, on the CPU."""

from __future__ import annotations

import json
import sys

import pytest

import pd.engine.model_runner
import pd.engine.step_inputs
from bench import step_overhead

pytestmark = pytest.mark.slow  # a real engine through 2 x 8 steps: the full tier


def test_a_small_run_times_every_phase_of_both_modes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["step_overhead", "--batches", "4", "--steps", "3"])
    step_overhead.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sync, ahead, summary = rows
    assert (sync["mode"], ahead["mode"], summary["batch"]) == ("sync", "async", 4)
    for row in (sync, ahead):
        phases = row["phases_ms"]
        # Every phase's timer sits where the engine calls it: none of the host's phases reads zero.
        assert all(phases[name] > 0 for name in ("schedule", "flatten", "to_device", "forward", "sample", "update"))
        assert row["host_ms_per_step"] > 0 and row["isa"]
    assert ahead["steps_launched_ahead"] > 0
    # The timers are taken off again: the next case (and any later engine) runs the functions themselves.
    assert pd.engine.model_runner.flatten is pd.engine.step_inputs.flatten
    assert pd.engine.model_runner.to_device is pd.engine.step_inputs.to_device
