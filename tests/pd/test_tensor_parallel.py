"""Tensor parallelism inside one engine: shards, equality with the reference, refusals, a dead worker."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.engine.tp.driver import TPWorkerError
from pd.model.config import load_model_config
from pd.model.loader import load_weights, read_tensors
from pd.model.tp import TPShard, check_tp, kv_head_sources
from tests.reference import assert_greedy_match, hf_greedy

ARCHITECTURES = ["llama", "qwen2", "mistral", "qwen3", "llama_bias"]
PROMPT_LENS = (3, 29, 70)
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def prompts(vocab: int = 509, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.integration  # a worker process per rank
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_two_ranks_match_the_reference(kind, checkpoint, hf_model):
    """TP=2 equals HF (and so TP=1) under the near-tie rule: split heads, replicated KV heads (qwen3 has
    one), biases after the all-reduce, tied and odd-sized vocabularies; chunked so steps mix."""
    path = checkpoint(kind)
    model = hf_model(path)
    with LLM(str(path), num_blocks=64, tensor_parallel_size=2, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts(), GREEDY)
    for out, prompt in zip(outputs, prompts()):
        assert_greedy_match(out.token_ids, *hf_greedy(model, prompt, MAX_NEW))


def test_a_rank_loads_only_its_shard(checkpoint):
    """Each rank's slices are the full weights' (rows of QKV and gate/up, columns of o/down, vocabulary
    rows padded), and together they hold the model once plus the replicated norms."""
    path = checkpoint("llama_bias")
    config = load_model_config(path)
    full = read_tensors(path)
    whole = load_weights(path, config, torch.float32, torch.device("cpu"))
    shards = [load_weights(path, config, torch.float32, torch.device("cpu"), TPShard(r, 2)) for r in range(2)]
    replicated = sum(t.numel() * 4 for name, t in full.items()
                     if "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias")))
    assert sum(s.num_bytes for s in shards) == whole.num_bytes + replicated
    for shard in shards:
        assert shard.num_bytes < 0.52 * whole.num_bytes
    assert torch.equal(shards[1].embed_tokens[:254], full["model.embed_tokens.weight"][255:])
    assert torch.equal(shards[1].embed_tokens[254], torch.zeros(config.hidden_size))  # 509 = 255 + 254 + pad
    assert shards[1].vocab_start == 255


def test_ranges_split_and_replicate_heads(checkpoint):
    config = load_model_config(checkpoint("qwen3"))  # 4 heads, 1 KV head
    assert [TPShard(r, 2).heads(config) for r in range(2)] == [(0, 2), (2, 4)]
    assert [TPShard(r, 2).kv_heads(config) for r in range(2)] == [(0, 1), (0, 1)]  # replicated
    assert TPShard(1, 2).local_config(config).num_kv_heads == 1
    llama = load_model_config(checkpoint("llama"))  # 4 heads, 2 KV heads
    assert [TPShard(r, 2).kv_heads(llama) for r in range(2)] == [(0, 1), (1, 2)]
    assert [TPShard(r, 4).kv_heads(llama) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_sizes_that_cannot_split_the_model_are_refused(checkpoint):
    config = load_model_config(checkpoint("llama"))
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_tp(config, 3)
    with pytest.raises(ValueError, match="3 KV heads: one must divide the other"):
        check_tp(dataclasses.replace(config, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="intermediate size 255"):
        check_tp(dataclasses.replace(config, intermediate_size=255), 2)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(str(checkpoint("llama")), num_blocks=16, tensor_parallel_size=3)  # before any worker starts
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="KV tiers .* tensor_parallel_size or expert_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, host_kv_cache_bytes=1 << 20)


@pytest.mark.integration  # a worker process per rank
@pytest.mark.parametrize("kind, ranks", [("llama", {"tensor_parallel_size": 2}),
                                         ("qwen3_moe", {"expert_parallel_size": 2})])
def test_a_dead_worker_fails_the_engine_at_once_and_never_hangs(checkpoint, kind, ranks):
    """A worker killed between steps (of a tensor- or expert-parallel engine): the next step raises naming
    the rank (its group sockets close), well inside the collective timeout; closing reaps everything."""
    llm = LLM(str(checkpoint(kind)), num_blocks=32, tensor_parallel_timeout_s=30, **ranks)
    try:
        assert len(llm.generate([prompts()[0]], GREEDY)[0].token_ids) == MAX_NEW
        launcher = llm.engine.runner.workers.launcher
        [pid] = launcher.pids().values()
        os.kill(pid, signal.SIGKILL)
        launcher.processes[1].wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 1"):
            llm.generate([prompts()[1]], GREEDY)
        assert time.monotonic() - started < 10
    finally:
        llm.close()
    assert llm.engine.runner.workers is None


@pytest.mark.parametrize("source, dest", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 1), (1, 4), (4, 4)])
def test_every_destination_rank_finds_each_of_its_heads_once(checkpoint, source, dest):
    """Prefill split ``source`` to decode split ``dest`` (2 KV heads: 4 ranks replicate them): the runs cover
    exactly the destination rank's heads, each read from a source rank that holds it."""
    config = load_model_config(checkpoint("llama"))  # 4 heads, 2 KV heads
    for rank in range(dest):
        shard = TPShard(rank, dest)
        runs = kv_head_sources(config, source, shard)
        start, stop = shard.kv_heads(config)
        covered = []
        for src_rank, src_first, first, count in runs:
            src_start, src_stop = TPShard(src_rank, source).kv_heads(config)
            assert src_start + src_first + count <= src_stop  # the source holds them
            covered += [start + first + i for i in range(count)]
            assert all(src_start + src_first + i == start + first + i for i in range(count))  # the same heads
        assert covered == list(range(start, stop))
    # 4 -> 1: the single decode rank reads one head from each pair of replicas, two runs in all
    assert kv_head_sources(config, 4, TPShard(0, 1)) == [(0, 0, 0, 1), (2, 0, 1, 1)]
    assert kv_head_sources(config, 1, TPShard(1, 2)) == [(0, 1, 0, 1)]
