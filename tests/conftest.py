"""Fixtures shared by every test package: random-weight checkpoints and their HF models."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(kind)`` -> path of a cached random checkpoint of that architecture."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = make_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def hf_model():
    import transformers

    loaded = {}

    def get(path):
        if path not in loaded:
            loaded[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded[path]

    return get


def pytest_collection_modifyitems(config, items):
    """Destructive tests (replica kills) run after everything else."""
    items.sort(key=lambda item: item.get_closest_marker("destructive") is not None)


def pytest_runtest_setup(item):
    import os

    if item.get_closest_marker("soak") is not None and os.environ.get("PD_SOAK") != "1":
        pytest.skip("soak test: set PD_SOAK=1 to run it")
