"""CUDA-graph decode: buckets, and the padding rule of the static buffers (checked on CPU).

Capture and replay need a GPU (``make gpu-check`` runs them). What a replay
computes is ``DecodeGraphs.forward`` over the staged buffers, and that runs
anywhere: here it must give the eager step's logits and leave the KV pool
exactly as the eager step does, whatever the padding rows hold.
"""

from __future__ import annotations

import pytest
import torch

from pd.config import EngineConfig
from pd.engine.cuda_graphs import DecodeGraphs, bucket_sizes, is_decode_only
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import ScheduledRequest, SchedulerOutput
from pd.engine.request import Request
from pd.model.config import load_model_config
from pd.sampling_params import SamplingParams


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.fixture
def runner(checkpoint):
    model_dir = checkpoint("llama")
    config = EngineConfig(model=str(model_dir), block_size=4, attention_backend="torch")
    runner = ModelRunner(config, load_model_config(model_dir), model_dir, num_blocks=32, max_model_len=64)
    assert runner.graphs is None  # never on CPU
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    return runner


def decode_step(runner, contexts: list[int], tables: list[list[int]]):
    out = SchedulerOutput([])
    for i, context in enumerate(contexts):
        request = Request(f"r{i}", list(range(10, 10 + context + 1)), SamplingParams())
        request.num_computed_tokens = context
        out.scheduled.append(ScheduledRequest(request, 1, samples=i != 1))  # row 1 does not sample
    return runner.prepare(out, tables)


@torch.inference_mode()
def test_a_staged_bucket_computes_the_eager_step_and_padding_writes_nothing(runner):
    graphs = DecodeGraphs(runner.model, runner.kv_views, runner.backend, max_batch=8, max_blocks_per_seq=16,
                          device=runner.device)
    pool = runner.kv_cache.clone()
    # A wide step first, so that stale rows sit in the buffers when the narrower one is staged.
    wide = decode_step(runner, [5, 9, 2, 13, 7], [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10], [11, 12]])
    graphs.stage(wide, 8)
    step = decode_step(runner, [5, 9, 13], [[1, 2], [3, 4, 5], [7, 8, 9, 10]])
    assert is_decode_only(step) and graphs.bucket_for(3) == 4

    runner.kv_cache.copy_(pool)
    eager = runner.model.forward(step.token_ids, step.positions, step.attn, runner.kv_views, step.logits_indices)
    eager_pool = runner.kv_cache.clone()

    runner.kv_cache.copy_(pool)
    graphs.stage(step, 4)
    staged = graphs.forward(4)[step.logits_indices]

    torch.testing.assert_close(staged, eager, atol=1e-5, rtol=1e-5)
    # The step's own slots hold its K/V (to fp32 rounding: a 4-row GEMM is not a 3-row one) ...
    torch.testing.assert_close(runner.kv_cache, eager_pool, atol=1e-5, rtol=1e-5)
    # ... and the padding rows wrote no other slot.
    written = torch.zeros(runner.kv_cache.shape[0], runner.block_size, dtype=torch.bool)
    slots = step.attn.slot_mapping
    written[slots // runner.block_size, slots % runner.block_size] = True
    assert torch.equal(runner.kv_cache.movedim(4, 1)[~written], pool.movedim(4, 1)[~written])  # token dim first
    assert step.logits_indices.tolist() == [0, 2]


def test_a_prefill_step_is_not_replayed(runner):
    graphs = DecodeGraphs(runner.model, runner.kv_views, runner.backend, max_batch=8, max_blocks_per_seq=16,
                          device=runner.device)
    request = Request("p", list(range(10, 20)), SamplingParams())
    batch = runner.prepare(SchedulerOutput([ScheduledRequest(request, 10, samples=True)]), [[1, 2, 3]])
    assert not is_decode_only(batch)
    assert graphs.run(batch) is None


def test_a_block_table_wider_than_the_graphs_is_refused(runner):
    graphs = DecodeGraphs(runner.model, runner.kv_views, runner.backend, max_batch=8, max_blocks_per_seq=2,
                          device=runner.device)
    step = decode_step(runner, [9], [[3, 4, 5]])
    with pytest.raises(ValueError, match="wider than"):
        graphs.stage(step, 1)


def verify_step(runner, contexts: list[int], tables: list[list[int]], k: int):
    """Each sequence's last token and ``k`` drafts: ``k + 1`` new tokens a sequence, every row sampled."""
    out = SchedulerOutput([])
    for i, context in enumerate(contexts):
        request = Request(f"v{i}", list(range(10, 10 + context + 1)), SamplingParams())
        request.num_computed_tokens = context
        out.scheduled.append(ScheduledRequest(request, 1 + k, samples=True,
                                              draft_token_ids=tuple(range(40, 40 + k))))
    return runner.prepare(out, tables)


@torch.inference_mode()
def test_a_staged_verify_bucket_computes_the_eager_step_and_padding_writes_nothing(runner):
    k = 3
    graphs = DecodeGraphs(runner.model, runner.kv_views, runner.backend, max_batch=8, max_blocks_per_seq=16,
                          device=runner.device, query_lens=(1, k + 1))
    pool = runner.kv_cache.clone()
    wide = verify_step(runner, [5, 9, 2, 13, 7], [[1, 2, 13], [3, 4, 5, 17], [6, 14], [7, 8, 9, 10, 15], [11, 12, 16]], k)
    graphs.stage(wide, 8, k + 1)
    step = verify_step(runner, [5, 9, 13], [[1, 2, 13], [3, 4, 5, 17], [7, 8, 9, 10, 15]], k)
    assert step.query_len == k + 1 and not is_decode_only(step) and graphs.bucket_for(3, k + 1) == 4
    assert graphs.bucket_for(3, 7) is None  # no graph for another query length

    runner.kv_cache.copy_(pool)
    eager = runner.model.forward(step.token_ids, step.positions, step.attn, runner.kv_views, step.logits_indices)
    eager_pool = runner.kv_cache.clone()
    runner.kv_cache.copy_(pool)
    graphs.stage(step, 4, k + 1)
    staged = graphs.forward(4, k + 1)[step.logits_indices]

    torch.testing.assert_close(staged, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.kv_cache, eager_pool, atol=1e-5, rtol=1e-5)
    written = torch.zeros(runner.kv_cache.shape[0], runner.block_size, dtype=torch.bool)
    slots = step.attn.slot_mapping
    written[slots // runner.block_size, slots % runner.block_size] = True
    assert torch.equal(runner.kv_cache.movedim(4, 1)[~written], pool.movedim(4, 1)[~written])
    assert step.logits_indices.tolist() == list(range(3 * (k + 1)))


def test_uneven_steps_have_no_query_length():
    from pd.engine.step_inputs import uniform_query_len

    assert uniform_query_len([0, 1, 2, 3]) == 1
    assert uniform_query_len([0, 5, 10]) == 5
    assert uniform_query_len([0, 1, 10]) is None and uniform_query_len([0, 4, 5, 10]) is None
    assert uniform_query_len([0]) is None
