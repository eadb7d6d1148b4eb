"""DeepSeek's latent KV between a prefill and a decode engine: one latent row per token moves, at any split."""

from __future__ import annotations

import pytest
import torch

from pd import LLM
from pd.engine.kv_layout import kv_block_bytes
from tests.transfer.test_engine_pairs import (
    ENGINE_KWARGS,
    GREEDY,
    PROMPTS,
    PrefillProcess,
    decode_engine,
    disaggregated,
)

pytestmark = pytest.mark.integration  # the prefill engine runs in a spawned process

BACKEND = {"attention_backend": "torch"}


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return str(checkpoint("deepseek_v3"))


@pytest.mark.parametrize("prefill_tp", [2])
def test_latent_blocks_move_once_and_decode_equals_colocated(model_dir, prefill_tp):
    """Prefill TP=2 -> decode TP=1 over NIXL: the tokens equal one colocated engine's, and the pull moves
    exactly one copy of each block's latent rows (NIXL's count), not one per prefill rank."""
    with LLM(model_dir, **{k: v for k, v in ENGINE_KWARGS.items() if k != "kv_lease_s"}, **BACKEND) as llm:
        [expected] = llm.generate([PROMPTS["a"]], GREEDY)
        model = llm.engine.model_config
    prefill = PrefillProcess(model_dir, "nixl", tensor_parallel_size=prefill_tp, **BACKEND)
    try:
        engine = decode_engine(model_dir, "nixl", prefill, **BACKEND)
        try:
            assert disaggregated(engine, prefill, "a", PROMPTS["a"]) == expected.token_ids
            stats = engine.stats()
            latent_block = kv_block_bytes(model, 16, torch.float32)
            assert latent_block == model.num_layers * 16 * (32 + 8) * 4
            assert stats.num_pulled_blocks == 5 and stats.num_pulled_bytes == 5 * latent_block
            assert stats.num_recompute_fallbacks == 0
        finally:
            engine.close()
            engine.connector.transport.close()
    finally:
        prefill.stop()
