"""A prefill engine in one process and a decode engine in another equal one engine.

The prefill process pins the prompt's blocks and returns a KVHandle; this
process decodes, pulling the blocks over the real transport.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import time

import pytest
import torch

from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.engine.kv_layout import kv_block_bytes
from router.hashing import hash_block_tokens
from tests.transfer.engine_worker import prefill_worker
from transfer import KVHandle, WireError, create_transport

pytestmark = pytest.mark.integration  # the prefill engine runs in a spawned process

ENGINE_KWARGS = {"num_blocks": 96, "block_size": 16, "kv_lease_s": 3.0}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = {
    "a": list(range(5, 75)),  # 70 tokens: 4 full blocks and a partial one
    "b": list(range(5, 69)) + [300, 301, 302],  # shares 4 full blocks with "a"
    "c": list(range(200, 216)),  # exactly one full block
}


class PrefillProcess:
    def __init__(self, model_dir: str, kind: str, *, send_pause_s: float = 0.0, ucx_tls: str | None = None,
                 **engine_kwargs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.control, control_child = ctx.Pipe() if kind == "torch" else (None, None)
        self.process = ctx.Process(
            target=prefill_worker,
            args=(child, control_child, model_dir, kind, {**ENGINE_KWARGS, **engine_kwargs}, send_pause_s, ucx_tls),
            daemon=True,
        )
        self.process.start()
        ready = self._recv(120)
        assert ready[0] == "ready"

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("prefill process did not answer")
        return self.conn.recv()

    def call(self, *command, timeout: float = 60):
        self.conn.send(command)
        return self._recv(timeout)

    def control_call(self, peer: str, message: bytes) -> bytes:
        self.control.send(message)
        return self.control.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def decode_engine(model_dir: str, kind: str, prefill: PrefillProcess, **engine_kwargs) -> LLMEngine:
    options = {"role": "decode", "control": prefill.control_call} if kind == "torch" else {}
    transport = create_transport(kind, f"decode-{kind}", **options)
    return LLMEngine(EngineConfig(model=model_dir, **{**ENGINE_KWARGS, **engine_kwargs}), transport)


def run_to_end(engine: LLMEngine, request_id: str, timeout: float = 60) -> list[int]:
    tokens, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                if out.finished:
                    return tokens
        time.sleep(0.001)
    raise TimeoutError(f"request {request_id} did not finish")


def disaggregated(engine: LLMEngine, prefill: PrefillProcess, request_id: str, prompt: list[int]) -> list[int]:
    handle = KVHandle.decode(prefill.call("prefill", request_id, prompt))
    engine.add_request(request_id, prompt, GREEDY, remote_kv=handle)
    return [handle.first_token_id] + run_to_end(engine, request_id)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return str(checkpoint("llama"))


@pytest.fixture(scope="module")
def colocated(model_dir):
    llm = LLM(model_dir, **{k: v for k, v in ENGINE_KWARGS.items() if k != "kv_lease_s"})
    outputs = llm.generate(list(PROMPTS.values()), GREEDY)
    return {key: out.token_ids for key, out in zip(PROMPTS, outputs)}


@pytest.mark.parametrize("kind", ["nixl", "torch"])
def test_disaggregated_equals_colocated_with_and_without_prefix_hits(kind, model_dir, colocated):
    prefill = PrefillProcess(model_dir, kind)
    try:
        engine = decode_engine(model_dir, kind, prefill)
        assert disaggregated(engine, prefill, "a", PROMPTS["a"]) == colocated["a"]
        assert engine.stats().num_pulled_blocks == 5
        # "b" shares "a"'s 4 full blocks, which the decode side now caches: only 1 block moves.
        assert disaggregated(engine, prefill, "b", PROMPTS["b"]) == colocated["b"]
        assert engine.stats().num_pulled_blocks == 6
        assert disaggregated(engine, prefill, "c", PROMPTS["c"]) == colocated["c"]
        stats = engine.stats()
        assert stats.num_recompute_fallbacks == 0 and stats.num_used_blocks == 0
        # Every completion notification reached the prefill side: no lease is left.
        prefill.call("step", 0.2)
        remote = prefill.call("stats")
        assert remote["num_pinned_leases"] == 0 and remote["num_used_blocks"] == 0
        engine.connector.transport.close()
    finally:
        prefill.stop()


def test_lease_expiry_frees_blocks_and_decode_recomputes(model_dir, colocated):
    prefill = PrefillProcess(model_dir, "nixl", kv_lease_s=1.0)
    try:
        handle_bytes = prefill.call("prefill", "a", PROMPTS["a"])
        assert prefill.call("stats")["num_pinned_leases"] == 1
        prefill.call("step", 1.2)
        remote = prefill.call("stats")
        assert remote["num_pinned_leases"] == 0 and remote["num_leases_expired"] == 1
        assert remote["num_used_blocks"] == 0
        engine = decode_engine(model_dir, "nixl", prefill)
        engine.add_request("a", PROMPTS["a"], GREEDY, remote_kv=KVHandle.decode(handle_bytes))
        tokens = [KVHandle.decode(handle_bytes).first_token_id] + run_to_end(engine, "a")
        assert tokens == colocated["a"]
        assert engine.stats().num_recompute_fallbacks == 1 and engine.stats().num_remote_pulls == 0
        engine.connector.transport.close()
    finally:
        prefill.stop()


def test_refused_handles_move_nothing(model_dir, checkpoint):
    prefill = PrefillProcess(model_dir, "nixl")
    try:
        handle = KVHandle.decode(prefill.call("prefill", "a", PROMPTS["a"]))
        other = decode_engine(str(checkpoint("qwen2")), "nixl", prefill)
        with pytest.raises(WireError, match="fingerprint mismatch"):
            other.add_request("a", PROMPTS["a"], GREEDY, remote_kv=handle)
        with pytest.raises(WireError, match="covers 70 tokens"):
            same = decode_engine(model_dir, "nixl", prefill)
            same.add_request("x", PROMPTS["a"][:-1], GREEDY, remote_kv=handle)
        assert other.stats().num_remote_pulls == 0 and same.stats().num_remote_pulls == 0
        for engine in (other, same):
            engine.connector.transport.close()
    finally:
        prefill.stop()


def test_dead_prefill_peer_fails_the_pull_and_decode_recomputes(model_dir, colocated):
    prefill = PrefillProcess(model_dir, "nixl")
    try:
        handle = KVHandle.decode(prefill.call("prefill", "a", PROMPTS["a"]))
        engine = decode_engine(model_dir, "nixl", prefill, kv_read_timeout_s=3.0)
        prefill.process.kill()
        prefill.process.join(5)
        start = time.monotonic()
        engine.add_request("a", PROMPTS["a"], GREEDY, remote_kv=handle)
        tokens = [handle.first_token_id] + run_to_end(engine, "a", timeout=30)
        assert time.monotonic() - start < 15
        assert tokens == colocated["a"]
        stats = engine.stats()
        assert stats.num_recompute_fallbacks == 1 and stats.num_used_blocks == 0
        engine.connector.transport.close()
    finally:
        prefill.stop()


def test_a_decode_engine_pulls_only_what_its_own_tiers_lack(model_dir, colocated):
    """Blocks the decode engine demoted to its host tier are promoted there, not pulled again."""
    prefill = PrefillProcess(model_dir, "nixl")
    try:
        probe = LLM(model_dir, num_blocks=4).engine
        block_bytes = kv_block_bytes(probe.model_config, 16, probe.runner.dtype)
        engine = decode_engine(model_dir, "nixl", prefill, num_blocks=12, host_kv_cache_bytes=16 * block_bytes)
        assert disaggregated(engine, prefill, "a", PROMPTS["a"]) == colocated["a"]
        assert engine.stats().num_pulled_blocks == 5
        for index in range(3):  # local prompts that push "a"'s blocks out of the device pool, into the host tier
            engine.add_request(f"churn-{index}", list(range(300 + 64 * index, 364 + 64 * index)), GREEDY)
            run_to_end(engine, f"churn-{index}")
        first_block = hash_block_tokens(PROMPTS["a"], 16)[0]
        assert not engine.block_pool.is_cached(first_block) and first_block in engine.tiers.host
        promoted = engine.stats().num_promoted_blocks
        assert disaggregated(engine, prefill, "b", PROMPTS["b"]) == colocated["b"]
        stats = engine.stats()
        assert stats.num_promoted_blocks - promoted == 4  # "a"'s 4 full blocks, from the decode's own host tier
        assert stats.num_pulled_blocks == 6  # only "b"'s own last block moved
        assert stats.num_recompute_fallbacks == 0 and stats.num_used_blocks == 0
        engine.connector.transport.close()
    finally:
        prefill.stop()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 2)])
def test_engines_of_different_tensor_parallel_splits_equal_one_engine(model_dir, colocated, prefill_tp, decode_tp):
    """Each decode rank reads its KV heads from the prefill ranks that hold them (one descriptor per block
    and source); the prefill engine's lease ends on one notification, once every rank has read. Splits
    that differ (2 -> 1, 1 -> 2) run through Serve in tests/serve/test_tensor_parallel.py."""
    prefill = PrefillProcess(model_dir, "nixl", tensor_parallel_size=prefill_tp)
    try:
        engine = decode_engine(model_dir, "nixl", prefill, tensor_parallel_size=decode_tp)
        try:
            assert disaggregated(engine, prefill, "a", PROMPTS["a"]) == colocated["a"]
            assert disaggregated(engine, prefill, "b", PROMPTS["b"]) == colocated["b"]  # 4 blocks hit locally
            stats = engine.stats()
            assert stats.num_recompute_fallbacks == 0 and stats.num_remote_pulls == 2
            prefill.call("step", 0.2)
            remote = prefill.call("stats")
            assert remote["num_pinned_leases"] == 0 and remote["num_leases_expired"] == 0
        finally:
            engine.close()
            engine.connector.transport.close()
    finally:
        prefill.stop()


def test_fp8_pools_pair_at_half_the_bytes_and_other_scales_recompute(model_dir, tmp_path, caplog):
    """FP8 prefill -> FP8 decode gives the colocated FP8 tokens, moving half of bf16's bytes (as NIXL counts
    them); a decode pool of other scales or another dtype refuses the handle before a byte moves and
    recomputes, never decoding bytes that mean other values."""
    fp8 = {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}
    with LLM(model_dir, **{k: v for k, v in ENGINE_KWARGS.items() if k != "kv_lease_s"}, **fp8) as llm:
        [expected] = llm.generate([PROMPTS["a"]], GREEDY)
        num_layers = llm.engine.model_config.num_layers
        bf16_block = kv_block_bytes(llm.engine.model_config, 16, torch.bfloat16)
    prefill = PrefillProcess(model_dir, "nixl", **fp8)
    try:
        engine = decode_engine(model_dir, "nixl", prefill, **fp8)
        assert disaggregated(engine, prefill, "a", PROMPTS["a"]) == expected.token_ids
        stats = engine.stats()
        assert stats.num_pulled_blocks == 5 and stats.num_pulled_bytes == 5 * bf16_block // 2
        engine.connector.transport.close()
        scales = tmp_path / "scales.json"
        scales.write_text(json.dumps({"k_scale": [0.5] * num_layers, "v_scale": [0.5] * num_layers}))
        for other in ({**fp8, "kv_cache_scales": str(scales)}, {"dtype": "bfloat16"}):
            handle = prefill.call("prefill", "b", PROMPTS["b"])
            engine = decode_engine(model_dir, "nixl", prefill, **other)
            with caplog.at_level(logging.WARNING, logger="pd.engine.engine"):
                assert engine.open_kv_handle(handle, PROMPTS["b"]) is None
            assert "fingerprint mismatch" in caplog.text and "recomputing the prompt locally" in caplog.text
            engine.add_request("b", PROMPTS["b"], GREEDY)
            with LLM(model_dir, num_blocks=96, **other) as alone:
                [own] = alone.generate([PROMPTS["b"]], GREEDY)
            assert run_to_end(engine, "b") == own.token_ids
            assert engine.stats().num_remote_pulls == 0 and engine.stats().num_recompute_fallbacks == 1
            engine.connector.transport.close()
    finally:
        prefill.stop()
