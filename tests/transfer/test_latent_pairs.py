"""DeepSeek's latent KV between a prefill and a decode engine: one latent row per token moves, at any split."""

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

BACKEND = {"attention_backend": "cpu"}


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return str(checkpoint("deepseek_v3"))


@pytest.fixture(scope="module")
def colocated(model_dir):
    with LLM(model_dir, **{k: v for k, v in ENGINE_KWARGS.items() if k != "kv_lease_s"}, **BACKEND) as llm:
        [expected] = llm.generate([PROMPTS["a"]], GREEDY)
        return expected.token_ids, llm.engine.model_config


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_latent_blocks_move_once_and_decode_equals_colocated(model_dir, colocated, monkeypatch, prefill_tp,
                                                             decode_tp):
    """Prefill TP=2 -> decode TP=1, TP=1 -> TP=2 and TP=2 -> TP=2 over NIXL: the tokens equal one colocated
    engine's, and the pull moves exactly one copy of each block's latent rows, as NIXL counts every rank's
    reads: not one per prefill rank, nor one per decode rank. Decode rank 1 copies rank 0's, inside the engine."""
    expected, model = colocated
    pulls = []

    def recorded(*args, **kwargs):
        pulls.append(start_split_pull(*args, **kwargs))
        return pulls[-1]

    start_split_pull = connector.start_split_pull
    monkeypatch.setattr(connector, "start_split_pull", recorded)
    prefill = PrefillProcess(model_dir, "nixl", tensor_parallel_size=prefill_tp, **BACKEND)
    try:
        engine = decode_engine(model_dir, "nixl", prefill, tensor_parallel_size=decode_tp, **BACKEND)
        try:
            assert disaggregated(engine, prefill, "a", PROMPTS["a"]) == expected
            stats = engine.stats()
            latent_block = kv_block_bytes(model, 16, torch.float32)
            assert latent_block == model.num_layers * 16 * (32 + 8) * 4
            [pull] = pulls
            # NIXL's telemetry of the reads from the prefill engine, every decode rank's (none computed)
            assert pull.moved_bytes == 5 * latent_block
            assert pull.copied_bytes == (decode_tp - 1) * 5 * latent_block  # the other ranks' copies, in the engine
            assert stats.num_pulled_blocks == 5 and stats.num_pulled_bytes == 5 * latent_block
            assert stats.num_recompute_fallbacks == 0
            prefill.call("step", 0.2)
            remote = prefill.call("stats")  # the lease ended on the one notification
            assert remote["num_pinned_leases"] == 0 and remote["num_leases_expired"] == 0
        finally:
            engine.close()
            engine.connector.transport.close()
    finally:
        prefill.stop()
