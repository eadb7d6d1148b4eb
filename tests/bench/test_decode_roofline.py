"""``bench.decode_roofline``: the bytes a decode step must read, and a batch timed in both modes on the CPU."""

from __future__ import annotations

import argparse
import random
import time

import pytest

from bench import decode_roofline, random_models
from bench.decode_roofline import kv_bytes, roofline_ms, weight_bytes
from bench.random_models import SHAPES
from bench.timing import DeviceTimer

LLAMA3_8B_PARAMETERS = 8_030_261_248  # Meta's count for Llama-3-8B, embedding table included


def test_the_8b_step_reads_every_weight_but_the_embedding_table():
    shape = SHAPES["llama3-8b"]
    table = shape.vocab_size * shape.hidden_size
    assert weight_bytes(shape, 32, batch=0) == 2 * (LLAMA3_8B_PARAMETERS - table)
    assert weight_bytes(shape, 32, batch=32) - weight_bytes(shape, 32, batch=0) == 2 * 32 * shape.hidden_size


def test_the_weights_counted_are_the_hf_models_parameters():
    pytest.importorskip("transformers")
    model = random_models.build_model("tiny-llama", 3, "cpu")
    parameters = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert weight_bytes(SHAPES["tiny-llama"], 3, batch=0) == 2 * parameters


def test_the_kv_read_is_context_by_layers_by_k_and_v_by_kv_heads_by_head_dim_in_bf16():
    shape = SHAPES["llama3-8b"]
    assert kv_bytes(shape, 32, kv_tokens=32 * 1024) == 32 * 1024 * 32 * 2 * 8 * 128 * 2
    assert roofline_ms(4_000_000_000, copy_gbps=4000.0) == pytest.approx(1.0)  # 4 GB at 4 TB/s


def test_an_moe_shape_is_refused():
    with pytest.raises(ValueError, match="MoE"):
        weight_bytes(SHAPES["qwen3-30b-a3b"], 8, batch=1)


class ClockEvent:
    """A CUDA event's two methods on the host's clock, so that the real ``DeviceTimer`` runs on the CPU."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "ClockEvent") -> float:
        return 1e3 * (end.at - self.at)


def clock_timer(engine) -> DeviceTimer:
    return DeviceTimer(engine.runner, event=ClockEvent, synchronize=lambda: None)


def test_a_batch_is_timed_in_both_modes_once_its_prompts_are_in(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv(random_models.CACHE_ENV, str(tmp_path))
    path, _ = random_models.cached_checkpoint("tiny-llama", 2, device="cpu")
    args = argparse.Namespace(model="tiny-llama", layers=2, prompt_len=16, steps=2, async_scheduling=False)
    engine = decode_roofline.make_engine(path, args, max_batch=4, device="cpu")
    timer = clock_timer(engine)
    rows = decode_roofline.measure_batch(engine, timer, None, 4, 100.0, args, random.Random(0))
    timer.close()
    assert [row["mode"] for row in rows] == ["graphs", "eager"]
    warm = decode_roofline.WARM_UP_STEPS
    # After the prefill each request holds its prompt and one sampled token; step j attends to prompt + 1 + j keys.
    first_timed = [args.prompt_len + 1 + warm, args.prompt_len + 1 + 2 * warm + args.steps]
    for row, first in zip(rows, first_timed):
        assert row["every_row_decoded"] and 0 < row["device_ms"] <= row["step_ms"]
        assert row["context"] == first + (args.steps - 1) / 2
        assert row["kv_bytes"] == kv_bytes(SHAPES["tiny-llama"], 2, round(4 * row["context"]))
        bound_ms = (row["weight_bytes"] + row["kv_bytes"]) / 100.0 / 1e6
        assert row["fraction_of_roofline"] == pytest.approx(bound_ms / row["step_ms"], rel=1e-2)
    assert not engine.has_unfinished_requests()  # its requests aborted: the next batch starts clean
    engine.close()


def test_async_scheduling_times_graphs_only_and_every_step_still_decodes_every_row(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv(random_models.CACHE_ENV, str(tmp_path))
    path, _ = random_models.cached_checkpoint("tiny-llama", 2, device="cpu")
    args = argparse.Namespace(model="tiny-llama", layers=2, prompt_len=16, steps=3, async_scheduling=True)
    engine = decode_roofline.make_engine(path, args, max_batch=4, device="cpu")
    assert engine.pipeline is not None
    timer = clock_timer(engine)
    rows = decode_roofline.measure_batch(engine, timer, None, 4, 100.0, args, random.Random(0))
    timer.close()
    assert [row["mode"] for row in rows] == ["graphs_async"]
    assert rows[0]["every_row_decoded"] and rows[0]["step_ms"] > 0
    assert engine.step() == []  # reads the step in flight: its requests were aborted, so it emits nothing
    assert not engine.has_unfinished_requests()
    engine.close()


def test_verify_steps_are_timed_beside_the_decode_steps_they_are_compared_with(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv(random_models.CACHE_ENV, str(tmp_path))
    path, _ = random_models.cached_checkpoint("tiny-llama", 2, device="cpu")
    args = argparse.Namespace(model="tiny-llama", layers=2, prompt_len=16, steps=2, async_scheduling=False,
                              verify_k=3, verify_batches="4")
    engine = decode_roofline.make_engine(path, args, max_batch=4, device="cpu")
    speculator, engine.scheduler.speculator = engine.speculator, None
    timer = clock_timer(engine)
    rows = decode_roofline.measure_batch(engine, timer, None, 4, 100.0, args, random.Random(0), speculator)
    timer.close()
    assert [row["mode"] for row in rows] == ["graphs", "eager", "verify_graphs", "verify_eager"]
    assert all(row["every_row_decoded"] for row in rows[:2])  # the plain modes do not speculate
    for row in rows[2:]:
        assert 1.0 <= row["tokens_per_step"] <= 4.0 and row["step_over_decode"] > 0 and row["verify_k"] == 3
    assert engine.stats().spec_num_draft_tokens > 0
    assert not engine.has_unfinished_requests()
    engine.close()
