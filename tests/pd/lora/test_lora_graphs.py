"""CUDA graphs with LoRA adapters: the staged buffers (each row's slot among them) compute the eager step, with
adapter rows and without, and padding rows add no delta (checked on CPU, as ``tests/pd/test_cuda_graphs.py``
checks the rest: capture and replay need a GPU)."""

from __future__ import annotations

import torch

from pd.config import EngineConfig
from pd.engine.cuda_graphs import DecodeGraphs
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import ScheduledRequest, SchedulerOutput
from pd.engine.request import Request
from pd.lora.registry import LoraRegistry
from pd.model.config import load_model_config
from pd.sampling_params import SamplingParams
from tests.lora_adapters import make_adapter


def _step(runner, contexts, tables, loras):
    out = SchedulerOutput([])
    for i, (context, lora) in enumerate(zip(contexts, loras)):
        request = Request(f"r{i}", list(range(10, 10 + context + 1)), SamplingParams(), lora=lora)
        request.num_computed_tokens = context
        out.scheduled.append(ScheduledRequest(request, 1, samples=True))
    return runner.prepare(out, tables)


@torch.inference_mode()
def test_a_staged_lora_bucket_computes_the_eager_step(checkpoint, tmp_path):
    model_dir = checkpoint("llama")
    model = load_model_config(model_dir)
    registry = LoraRegistry(model, 16, 4)
    key = registry.add("a", make_adapter(model_dir, tmp_path / "a", r=4, seed=3))
    registry.acquire(key)
    config = EngineConfig(model=str(model_dir), block_size=4, attention_backend="torch", enable_lora=True,
                          max_loras=2)
    runner = ModelRunner(config, model, model_dir, num_blocks=32, max_model_len=64, lora=registry)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    graphs = DecodeGraphs(runner.model, runner.kv_views, runner.backend, max_batch=8, max_blocks_per_seq=16,
                          device=runner.device, lora_layers=runner.lora_slots.layers)
    pool = runner.kv_cache.clone()
    tables = [[1, 2], [3, 4, 5], [7, 8, 9, 10]]
    for loras, lora_graph in (([key, None, key], True), ([None, None, None], False), ([None, None, None], True)):
        step = _step(runner, [5, 9, 13], tables, loras)
        assert (step.attn.lora is not None) == (key in loras)
        runner.kv_cache.copy_(pool)
        eager = runner.model.forward(step.token_ids, step.positions, step.attn, runner.kv_views, step.logits_indices)
        runner.kv_cache.copy_(pool)
        wide = _step(runner, [5, 9, 2, 13, 7], [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10], [11, 12]], [key] * 5)
        graphs.stage(wide, 8)  # stale slots in the buffers
        runner.kv_cache.copy_(pool)
        graphs.stage(step, 4)
        staged = graphs.forward(4, query_len=1, lora=lora_graph)[step.logits_indices]
        torch.testing.assert_close(staged, eager, atol=1e-5, rtol=1e-5)
    plain = _step(runner, [5, 9, 13], tables, [None] * 3)
    adapted = _step(runner, [5, 9, 13], tables, [key, None, key])
    runner.kv_cache.copy_(pool)
    base_logits = runner.model.forward(plain.token_ids, plain.positions, plain.attn, runner.kv_views,
                                       plain.logits_indices)
    runner.kv_cache.copy_(pool)
    lora_logits = runner.model.forward(adapted.token_ids, adapted.positions, adapted.attn, runner.kv_views,
                                       adapted.logits_indices)
    assert not torch.allclose(base_logits[0], lora_logits[0])  # the adapter changes its rows ...
    torch.testing.assert_close(base_logits[1], lora_logits[1])  # ... and no other
