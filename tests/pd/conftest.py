"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from pd import LLM
from pd.engine.kv_layout import kv_block_bytes
from tests.pd.tiers_common import DEVICE_BLOCKS, FIRST, PARAMS


@pytest.fixture(scope="session")
def block_bytes():
    llm = LLM("builtin:tiny-llama", num_blocks=8)
    return kv_block_bytes(llm.engine.model_config, 16, llm.engine.runner.dtype)


@pytest.fixture(scope="session")
def reference():
    """FIRST's greedy tokens on an engine without tiers."""
    [out] = LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS).generate([FIRST], PARAMS)
    return out.token_ids
