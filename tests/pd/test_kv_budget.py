"""The KV pool's size: what the config gives, or ``gpu_memory_utilization`` of a CUDA device's memory.

The arithmetic takes the figures a CUDA profile measures as plain arguments, so every case runs here;
the profile's steps themselves run on the CPU too (their memory is measured only on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from pd import LLM
from pd.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from pd.config.app import AppArgs
from pd.engine.derived import num_pool_blocks
from pd.engine.kv_budget import (
    DeviceMemory,
    DeviceShare,
    graph_reserve,
    kv_cache_blocks,
    pool_size,
    profile_lengths,
)
from pd.engine.kv_layout import kv_block_bytes
from pd.engine.kv_profile import profile_step
from pd.engine.tp.driver import TP_WIRE_VERSION, WorkerSpec, read_worker_spec, worker_spec_json
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from tests.serve.conftest import config_args

GIB = 1024**3
MIB = 1024**2
BLOCK = 2 * MIB  # a Llama-3-8B block of 16 bf16 tokens


def device(total=80 * GIB, free=63 * GIB, in_use=16 * GIB, peak=2 * GIB, graphs=1 * GIB) -> DeviceMemory:
    """An 80 GiB device with 16 GiB of weights in (and 1 GiB the CUDA context holds, not counted as ours)."""
    return DeviceMemory(total=total, free=free, in_use=in_use, peak_activations=peak, graph_reserve=graphs)


def test_the_pool_takes_the_share_left_after_weights_activations_and_graphs():
    # 0.9 of 80 GiB is 72 GiB: 16 of weights, 2 of activations, 1 of graphs leave 53 GiB of blocks.
    assert kv_cache_blocks([device()], 0.9, BLOCK, min_blocks=1) == 53 * GIB // BLOCK
    assert kv_cache_blocks([device()], 0.5, BLOCK, min_blocks=1) == 21 * GIB // BLOCK
    assert kv_cache_blocks([device(graphs=0)], 0.5, BLOCK, min_blocks=1) == 22 * GIB // BLOCK
    # A partial block is not a block.
    assert kv_cache_blocks([device(peak=2 * GIB + 1)], 0.5, BLOCK, min_blocks=1) == 21 * GIB // BLOCK - 1


def test_a_busy_device_caps_the_pool_at_what_is_free():
    # Other processes hold 33 GiB: 30 GiB are free, of which the steps need 3.
    busy = device(free=30 * GIB)
    assert kv_cache_blocks([busy], 0.9, BLOCK, min_blocks=1) == 27 * GIB // BLOCK
    assert busy.kv_bytes(0.9) == 27 * GIB
    assert kv_cache_blocks([busy], 0.5, BLOCK, min_blocks=1) == 21 * GIB // BLOCK  # the share binds first


def test_the_share_bounds_the_pool_even_when_more_is_free():
    assert kv_cache_blocks([device(free=80 * GIB)], 0.5, BLOCK, min_blocks=1) == 21 * GIB // BLOCK


def test_weights_too_big_for_the_share_are_refused_naming_the_field_and_the_figures():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0\.9 .* 0 KV blocks") as raised:
        kv_cache_blocks([device(in_use=70 * GIB, free=9 * GIB)], 0.9, BLOCK, min_blocks=512)
    message = str(raised.value)
    assert "70.0 GiB" in message and "2.0 GiB" in message and "max_model_len" in message
    assert "512" in message


def test_a_pool_smaller_than_one_max_length_request_is_refused():
    # 0.25 of 80 GiB leaves 1 GiB: 512 blocks, and a request of max_model_len needs 513.
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.25 .* 512 KV blocks .* needs 513"):
        kv_cache_blocks([device()], 0.25, BLOCK, min_blocks=513)
    assert kv_cache_blocks([device()], 0.25, BLOCK, min_blocks=512) == 512


def test_a_busy_device_says_so_when_it_leaves_no_room():
    # 0.5 GiB free beside the steps' 3: 256 blocks, where a max-length request needs 512.
    with pytest.raises(ValueError, match=r"256 KV blocks .* only 3\.5 GiB of the device is free"):
        kv_cache_blocks([device(free=3 * GIB + GIB // 2)], 0.9, BLOCK, min_blocks=512)


def test_every_rank_takes_the_fewest_blocks_any_rank_has_room_for():
    ranks = [device(), device(in_use=20 * GIB), device(free=40 * GIB)]
    assert kv_cache_blocks(ranks, 0.9, BLOCK, min_blocks=1) == 37 * GIB // BLOCK
    with pytest.raises(ValueError, match="rank 1's device"):
        kv_cache_blocks([device(), device(in_use=70 * GIB)], 0.9, BLOCK, min_blocks=1)


def test_the_graph_reserve_is_the_largest_captured_step_and_every_smaller_buckets_logits():
    # Buckets 1, 2, 4, 8, 16: the largest one's forward, plus the logits the other 15 rows keep in the pool.
    assert graph_reserve(decode_peak=100 * MIB, logits_row_bytes=MIB, buckets=[1, 2, 4, 8, 16]) == 115 * MIB
    assert graph_reserve(decode_peak=7, logits_row_bytes=3, buckets=[1]) == 7


@pytest.mark.parametrize("tokens, seqs, max_len, lengths", [
    (2048, 256, 4096, [8] * 256),  # vLLM's profile run: the token budget spread over the most sequences
    (10, 4, 4096, [3, 3, 2, 2]),
    (4, 256, 4096, [1] * 4),  # never more sequences than tokens
    (8192, 2, 1024, [1024, 1024]),  # no sequence longer than max_model_len: the step can hold no more
])
def test_the_profile_step_is_the_largest_step_the_scheduler_may_make(tokens, seqs, max_len, lengths):
    assert profile_lengths(tokens, seqs, max_len) == lengths


def test_num_blocks_overrides_kv_cache_bytes_which_overrides_the_share():
    assert pool_size(EngineConfig(device="cuda"), BLOCK) == DeviceShare(0.9)
    assert pool_size(EngineConfig(device="cuda:1", gpu_memory_utilization=0.5), BLOCK) == DeviceShare(0.5)
    assert pool_size(EngineConfig(device="cuda", kv_cache_bytes=GIB), BLOCK) == 512
    assert pool_size(EngineConfig(device="cuda", kv_cache_bytes=GIB, num_blocks=7), BLOCK) == 7
    assert pool_size(EngineConfig(device="cuda", num_blocks=7), BLOCK) == 7


def test_a_cpu_engine_keeps_its_bytes_whatever_the_share():
    assert EngineConfig().kv_cache_bytes is None and DEFAULT_KV_CACHE_BYTES == 2 * GIB
    assert pool_size(EngineConfig(), BLOCK) == 1024
    assert pool_size(EngineConfig(gpu_memory_utilization=0.1), BLOCK) == 1024
    assert pool_size(EngineConfig(kv_cache_bytes=GIB), BLOCK) == 512
    assert pool_size(EngineConfig(kv_cache_bytes=1), BLOCK) == 1  # at least one block, as before


def test_the_engine_sizes_a_cpu_pool_as_before_and_asks_a_cuda_runner_to_measure():
    model = load_model_config(resolve_model_path("builtin:tiny-llama"))
    assert num_pool_blocks(EngineConfig(), model, None) == DEFAULT_KV_CACHE_BYTES // kv_block_bytes(
        model, 16, torch.float32)
    assert LLM("builtin:tiny-llama", kv_cache_bytes=64 * kv_block_bytes(model, 16, torch.float32)).num_blocks == 64
    assert num_pool_blocks(EngineConfig(device="cuda"), model, None) == DeviceShare(0.9)


@pytest.mark.parametrize("value", [0, -0.5, 1.01, 2])
def test_a_share_outside_zero_to_one_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        AppArgs.model_validate({**config_args("default.yaml"), "engine": {"gpu_memory_utilization": value}})


def test_the_whole_device_and_explicit_bytes_are_accepted_and_zero_bytes_refused():
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    with pytest.raises(ValueError, match="kv_cache_bytes must be >= 1"):
        EngineConfig(kv_cache_bytes=0)
    engine = AppArgs.model_validate({**config_args("default.yaml"),
                                     "engine": {"device": "cuda", "gpu_memory_utilization": 0.8}}).engine
    assert (engine.gpu_memory_utilization, engine.kv_cache_bytes) == (0.8, None)


def test_tensor_parallel_workers_are_told_to_size_their_pools_from_their_devices():
    def spec(num_blocks):
        return WorkerSpec(version=TP_WIRE_VERSION, rank=1, size=2, engine_config={}, model_dir="m", device="cuda:1",
                          num_blocks=num_blocks, max_model_len=8, driver_host="h", driver_port=1, store_port=2,
                          authkey="00")

    assert read_worker_spec(worker_spec_json(spec(DeviceShare(0.85)))).num_blocks == DeviceShare(0.85)
    assert read_worker_spec(worker_spec_json(spec(12))).num_blocks == 12


@pytest.mark.parametrize("lengths, every_row", [([3, 3, 2, 2], False), ([1] * 4, True)])
def test_the_profile_steps_run_the_model_on_a_scratch_pool_of_one_block(lengths, every_row):
    """The CUDA profile's steps, run here: they write no KV and read block 0 only."""
    llm = LLM("builtin:tiny-llama", num_blocks=1)
    runner = llm.engine.runner
    before = runner.kv_cache.clone()
    token_ids, positions, attn, logits_indices = profile_step(lengths, max_blocks=4, every_row=every_row,
                                                              device=runner.device, backend=runner.backend)
    assert positions.tolist() == [p for n in lengths for p in range(n)]
    logits = runner.model.forward(token_ids, positions, attn, runner.kv_views, logits_indices)
    assert logits.shape == (sum(lengths) if every_row else len(lengths), llm.engine.model_config.vocab_size)
    assert logits.isfinite().all()
    assert (runner.kv_cache == before).all()  # nothing written


class FakeAllocator:
    """``torch.cuda``'s memory figures, scripted: each step peaks at the next of ``peaks`` above what was live."""

    def __init__(self, total: int, free: int, peaks: list[int], live: int = 5 * MIB):
        self.total, self.free, self.peaks, self.live = total, free, list(peaks), live
        self.steps = 0

    def mem_get_info(self, device=None):
        return self.free, self.total

    def memory_allocated(self, device=None):
        return self.live

    def reset_peak_memory_stats(self, device=None):
        self.steps += 1

    def max_memory_allocated(self, device=None):
        return self.live + self.peaks[self.steps - 1]

    def nothing(self, device=None):
        pass


def test_fit_pool_puts_each_allocator_figure_where_the_arithmetic_wants_it(monkeypatch):
    """The CUDA side's plumbing, run on the CPU with the allocator's figures scripted."""
    from pd.engine import kv_profile

    llm = LLM("builtin:tiny-llama", num_blocks=1, max_num_seqs=4, cuda_graph_max_batch=8)
    runner = llm.engine.runner
    fake = FakeAllocator(total=80 * GIB, free=60 * GIB, peaks=[2 * GIB, 100 * MIB])
    for name in ("mem_get_info", "memory_allocated", "reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, fake.nothing)
    monkeypatch.setattr(kv_profile, "captures_graphs", lambda *args: True)  # as a CUDA runner of one rank

    blocks = kv_profile.fit_pool(runner, DeviceShare(0.9), free_at_start=76 * GIB, max_model_len=64)
    assert fake.steps == 2  # the largest step, then the largest captured decode batch
    block_bytes = kv_block_bytes(llm.engine.model_config, 16, torch.float32)
    logits_row = llm.engine.model_config.vocab_size * 4
    reserve = 100 * MIB + logits_row * (1 + 2)  # buckets 1, 2, 4: the two smaller ones' logits
    assert blocks == (72 * GIB - 16 * GIB - 2 * GIB - reserve) // block_bytes
    fake.steps = 0
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.2"):  # 16 GiB of 80 hold the weights alone
        kv_profile.fit_pool(runner, DeviceShare(0.2), free_at_start=76 * GIB, max_model_len=64)
