"""KV heads replicated over a decode engine's ranks cross from the prefill engine once: the first rank
holding them pulls, the others copy them from its pool (``pd.engine.disagg.pulls``). GQA with fewer KV heads
than ranks (qwen3: one KV head at TP=2) and attention whole on each expert-parallel rank (qwen3-moe, EP=2).
DeepSeek's latent: tests/transfer/test_latent_pairs.py."""

from __future__ import annotations

import pytest
import torch

from pd import LLM
from pd.engine.disagg import connector
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


@pytest.mark.parametrize("kind, decode_kwargs", [("qwen3", {"tensor_parallel_size": 2}),
                                                 ("qwen3_moe", {"expert_parallel_size": 2})])
def test_replicated_heads_cross_once_and_decode_equals_colocated(checkpoint, monkeypatch, kind, decode_kwargs):
    """Prefill TP=1 -> a decode engine of 2 ranks that both hold every KV head: the tokens equal one colocated
    engine's; NIXL counts one copy of each block read from the prefill engine and one copied to rank 1."""
    model_dir = str(checkpoint(kind))
    with LLM(model_dir, **{k: v for k, v in ENGINE_KWARGS.items() if k != "kv_lease_s"}) as llm:
        [expected] = llm.generate([PROMPTS["a"]], GREEDY)
        model = llm.engine.model_config
    pulls = []

    def recorded(*args, **kwargs):
        pulls.append(start_split_pull(*args, **kwargs))
        return pulls[-1]

    start_split_pull = connector.start_split_pull
    monkeypatch.setattr(connector, "start_split_pull", recorded)
    prefill = PrefillProcess(model_dir, "nixl")
    try:
        engine = decode_engine(model_dir, "nixl", prefill, **decode_kwargs)
        try:
            assert disaggregated(engine, prefill, "a", PROMPTS["a"]) == expected.token_ids
            block = kv_block_bytes(model, 16, torch.float32)  # every KV head: each rank's pool holds them all
            [pull] = pulls
            assert (pull.moved_bytes, pull.copied_bytes) == (5 * block, 5 * block)
            stats = engine.stats()
            assert stats.num_pulled_bytes == 5 * block and stats.num_recompute_fallbacks == 0
        finally:
            engine.close()
            engine.connector.transport.close()
    finally:
        prefill.stop()
