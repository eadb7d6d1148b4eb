"""KV tiers: the host tier's copy speed against memcpy, and its prefix hit rate and TTFT on multi-turn chat.

    python -m bench.kv_tiers [--device-blocks 128] [--host-blocks 1024] [--groups 2]

Prints one JSON object. Each figure is measured in this run, on this machine:

- ``host_to_device_gb_per_s``: promotions (one ``copy_`` per block, as the
  tier does them) of every block of a full host tier; ``memcpy_gb_per_s``:
  one copy of the same bytes as a single contiguous tensor; medians of 5.
- ``hit_rate_*``: prefix-hit tokens over prompt tokens, from the engine's own
  counters, replaying the load test's ``chat`` workload (conversations over
  shared system prompts, growing turn by turn) on the built-in model with a
  device pool of ``--device-blocks`` (a quarter of the workload's distinct
  blocks) alone (``device_only``), with a host tier
  of ``--host-blocks`` behind it (``tiered``), and with a pool that never
  evicts (``unbounded``).
- ``ttft_p50_*_s``: each request's time from submission to its first token,
  requests one at a time (the same offered load for every configuration).

The disk tier, the shared store and warm restarts are not built yet: their
fields are null.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.stats import percentile
from loadtest.workloads import ChatWorkload
from pd.engine.host_tier import HostTier

BLOCK_SIZE = 16
MODEL = "builtin:tiny-llama"


def copy_speeds(block_shape: tuple[int, ...], num_blocks: int, repeats: int = 5) -> dict[str, float]:
    """Promotion bandwidth of a full tier against one memcpy of the same bytes (GB/s, medians)."""
    device = torch.randn(num_blocks, *block_shape)
    tier = HostTier(device, num_blocks)
    hashes = [index.to_bytes(8, "little") for index in range(num_blocks)]
    for block_id, block_hash in enumerate(hashes):
        tier.demote(block_id, block_hash, (block_id,))
    total_bytes = device.numel() * device.element_size()
    promote_s, memcpy_s = [], []
    for _ in range(repeats):
        tier.reserve(hashes)
        started = time.perf_counter()
        for block_id, block_hash in enumerate(hashes):
            tier.promote(block_hash, block_id)
        promote_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        device.copy_(tier.cache)
        memcpy_s.append(time.perf_counter() - started)
    promote, memcpy = total_bytes / statistics.median(promote_s) / 1e9, total_bytes / statistics.median(memcpy_s) / 1e9
    return {"host_to_device_gb_per_s": round(promote, 2), "memcpy_gb_per_s": round(memcpy, 2),
            "host_ratio_vs_memcpy": round(promote / memcpy, 3), "copy_bytes": total_bytes}


def chat_prompts(num_groups: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """The chat workload's first ``num_groups`` groups as (prompt token ids, max tokens), in order."""
    from pd.model.paths import resolve_model_path
    from pd.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_path(MODEL))
    workload = ChatWorkload(seed=seed, output_len=8)
    prompts = []
    for index in range(num_groups * workload.group_size * workload.num_turns):
        request = workload.request(index)
        messages = [{"role": role, "content": text} for role, text in request.messages]
        text = tokenizer.apply_chat_template(messages)
        prompts.append((tokenizer.encode(text, add_special_tokens=False), request.max_tokens))
    return prompts


def distinct_blocks(prompts: list[tuple[list[int], int]]) -> int:
    """The workload's working set: distinct full blocks over every prompt (what an unbounded cache holds)."""
    from router.hashing import hash_block_tokens

    return len({h for ids, _ in prompts for h in hash_block_tokens(ids, BLOCK_SIZE)})


def replay(prompts: list[tuple[list[int], int]], **engine_kwargs) -> dict[str, float]:
    """Each prompt alone, in order: the prefix hit rate and TTFT p50 the engine saw."""
    from pd import SamplingParams
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=MODEL, block_size=BLOCK_SIZE, **engine_kwargs))
    ttfts = []
    for index, (token_ids, max_tokens) in enumerate(prompts):
        started, first = time.perf_counter(), None
        engine.add_request(str(index), token_ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                 ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - started
        ttfts.append(first)
    stats = engine.stats()
    return {"hit_rate": round(stats.num_prefix_hit_tokens / stats.num_prompt_tokens, 4),
            "ttft_p50_s": round(percentile(ttfts, 50), 5), "prompt_tokens": stats.num_prompt_tokens,
            "promoted_blocks": stats.num_promoted_blocks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-blocks", type=int, default=None,
                        help="default: a quarter of the workload's distinct blocks")
    parser.add_argument("--host-blocks", type=int, default=1024)
    parser.add_argument("--groups", type=int, default=2, help="groups of 16 four-turn conversations")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    prompts = chat_prompts(args.groups)
    from pd.engine.model_runner import kv_block_bytes
    from pd.model.config import load_model_config
    from pd.model.paths import resolve_model_path

    model_config = load_model_config(resolve_model_path(MODEL))
    block_bytes = kv_block_bytes(model_config, BLOCK_SIZE, torch.float32)
    unbounded_blocks = sum(-(-len(ids) // BLOCK_SIZE) + 1 for ids, _ in prompts)
    working_set = distinct_blocks(prompts)
    device_blocks = args.device_blocks or working_set // 4
    runs = {
        "device_only": replay(prompts, num_blocks=device_blocks),
        "tiered": replay(prompts, num_blocks=device_blocks, host_kv_cache_bytes=args.host_blocks * block_bytes),
        "unbounded": replay(prompts, num_blocks=unbounded_blocks),
    }
    block_shape = (model_config.num_layers, 2, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim)
    # The same at a Llama-3-8B block (32 layers, 8 KV heads of 128, 16 tokens; fp32 here: 4 MiB).
    large = copy_speeds((32, 2, BLOCK_SIZE, 8, 128), 64)
    row = {
        **copy_speeds(block_shape, args.host_blocks),
        "llama3_8b_block": {key: large[key] for key in ("host_to_device_gb_per_s", "memcpy_gb_per_s",
                                                        "host_ratio_vs_memcpy")},
        "disk_read_gb_per_s": None, "plain_read_gb_per_s": None, "disk_ratio_vs_plain": None,
        **{f"hit_rate_{name}": run["hit_rate"] for name, run in runs.items()},
        "ttft_p50_tiered_s": runs["tiered"]["ttft_p50_s"], "ttft_p50_device_only_s": runs["device_only"]["ttft_p50_s"],
        "ttft_p50_unbounded_s": runs["unbounded"]["ttft_p50_s"],
        "tiered_vs_unbounded_hit_rate": round(runs["tiered"]["hit_rate"] / runs["unbounded"]["hit_rate"], 3),
        "device_only_vs_tiered_ttft_p50": round(runs["device_only"]["ttft_p50_s"] / runs["tiered"]["ttft_p50_s"], 3),
        "warm_restart_hit_ratio": None,
        "requests": len(prompts), "prompt_tokens": runs["unbounded"]["prompt_tokens"],
        "working_set_blocks": working_set, "device_blocks": device_blocks,
        "host_blocks": args.host_blocks, "block_bytes": block_bytes,
        "promoted_blocks": runs["tiered"]["promoted_blocks"], "model": MODEL,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
