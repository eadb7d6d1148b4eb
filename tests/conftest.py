"""Fixtures shared by every test package: random-weight checkpoints and their HF models."""

from __future__ import annotations

import contextlib
import os

# Nothing in the suite reaches the network: hub ids resolve from local caches only. Read by huggingface_hub
# when imported, so set before anything imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run in its interpreter on CPU (tests/pd_kernels/conftest.py). TRITON_INTERPRET is read when
# ``@triton.jit`` decorates a function, so it is set before collection imports any module that decorates one.
if os.environ.get("PD_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.tiers import INTEGRATION, INTEGRATION_FIXTURES, refuse_processes, unit_tier  # noqa: E402

CLUSTER = "cluster"  # a registered marker (pyproject.toml)
SERVE_TESTS = "tests/serve/"


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
            # MoE models run HF's eager expert loop, the reference our fused MoE answers to.
            loaded[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, experts_implementation="eager").eval()
        return loaded[path]

    return get


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Tests on a Ray cluster are integration tests; destructive tests (replica kills) run after everything else.

    Before them, the tests on the plain default app (the ``default_app`` fixture) run together, ahead of those that
    deploy an app of their own: switching apps redeploys every replica, about 8 s on two cores.

    The Serve tests that start anything are marked ``cluster``: they share one Ray cluster and the app's ports,
    so ``make test`` runs them in order, after the rest in parallel.
    """
    for item in items:
        on_cluster = INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if on_cluster:
            item.add_marker(INTEGRATION)
        if item.get_closest_marker(INTEGRATION) is not None and (item.nodeid.startswith(SERVE_TESTS) or on_cluster):
            item.add_marker(CLUSTER)
    items.sort(key=lambda item: (item.get_closest_marker("destructive") is not None, _deploys_its_own_app(item)))


def _deploys_its_own_app(item) -> bool:
    fixtures = getattr(item, "fixturenames", ())
    return "ray_cluster" in fixtures and "default_app" not in fixtures


def _guarded(item):
    """In the unit tier, a test not marked integration may start no process (``tests/tiers.py``)."""
    if unit_tier() and item.get_closest_marker(INTEGRATION) is None:
        return refuse_processes(item.nodeid)
    return contextlib.nullcontext()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("soak") is not None and os.environ.get("PD_SOAK") != "1":
        pytest.skip("soak test: set PD_SOAK=1 to run it")
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _guarded(item):
        return (yield)


# Chat prompts for the checks on a trained model, SmolLM2-135M-Instruct.
SMOLLM2 = "builtin:smollm2-135m-instruct"
SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a CPU does in one sentence.",
    "Give me three tips for sleeping better.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
]


@pytest.fixture(scope="session")
def smollm2_hf():
    """``(model, tokenizer)``: HF ``transformers`` reading the shipped SmolLM2 GGUF itself (its own dequantizer;
    ``tests.reference.hf_from_gguf``)."""
    from pd.model.builtin import PACKAGED_MODELS
    from tests.reference import hf_from_gguf

    return hf_from_gguf(PACKAGED_MODELS[SMOLLM2.removeprefix("builtin:")].gguf_path())
