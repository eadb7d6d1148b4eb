"""KV tiers on multi-turn chat: prefix hit rate, TTFT, the tiers' speeds and a warm restart.

    python -m bench.kv_tiers [--groups 2] [--turns 6] [--device-blocks N] [--host-blocks N]

Prints one JSON object. Each figure is measured in this run, on this machine:

- ``hit_rate_*``: prefix-hit tokens over prompt tokens, from the engine's own
  counters, replaying the load test's ``chat`` workload (conversations over
  shared system prompts, growing turn by turn) on the built-in model, one
  request at a time. ``device_only``: a device pool of a quarter of the
  workload's distinct blocks; ``tiered``: that pool with a host tier of an eighth
  of them (``--host-blocks``) and a disk tier (NIXL POSIX, in a temporary
  directory) under it; ``unbounded``: a pool that never evicts.
- ``ttft_p50_*_s``: each request's time from submission to its first token.
- the tiers' speeds (``bench.tier_speeds``): host -> device against memcpy,
  disk -> host against plain reads of the same files, with this model's
  blocks, and with a Llama-3-8B-sized block (``llama3_8b_block``).
- ``warm_restart_hit_ratio``: the workload's last 50 requests (later turns
  of conversations whose earlier turns came before) served by an engine
  that was killed (SIGKILL, in its own process) after the first requests and
  restarted on its disk tier, over the hit rate the same 50 requests got
  from the engine that served the first ones without a kill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from bench import tier_speeds
from pd.workload.stats import percentile
from pd.workload.workloads import ChatWorkload

BLOCK_SIZE = 16
MODEL = "builtin:tiny-llama"
RESTART_REQUESTS = 50
LLAMA3_8B_BLOCK = (32, 2, BLOCK_SIZE, 8, 128)  # layers, K and V, tokens, KV heads, head dim: 4 MiB in fp32


def chat_prompts(num_groups: int, num_turns: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """The chat workload's first ``num_groups`` groups of ``num_turns``-turn conversations as (prompt
    token ids, max tokens), in order."""
    from pd.model.paths import resolve_model_path
    from pd.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_path(MODEL))
    workload = ChatWorkload(seed=seed, output_len=8, num_turns=num_turns)
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


def engine(**engine_kwargs):
    from pd.config import EngineConfig
    from pd.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=MODEL, block_size=BLOCK_SIZE, **engine_kwargs))


def serve(llm, prompts: list[tuple[list[int], int]]) -> dict[str, float]:
    """Each prompt alone, in order: the prefix hit rate and TTFT p50 ``llm`` (an ``LLMEngine``) gave them."""
    from pd import SamplingParams

    before, ttfts = llm.stats(), []
    for index, (token_ids, max_tokens) in enumerate(prompts):
        started, first = time.perf_counter(), None
        llm.add_request(f"{len(ttfts)}-{index}-{time.monotonic_ns()}", token_ids,
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        while llm.has_unfinished_requests():
            for out in llm.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - started
        ttfts.append(first)
    after = llm.stats()
    prompt_tokens = after.num_prompt_tokens - before.num_prompt_tokens
    return {"hit_rate": round((after.num_prefix_hit_tokens - before.num_prefix_hit_tokens) / prompt_tokens, 4),
            "ttft_p50_s": round(percentile(ttfts, 50), 5), "prompt_tokens": prompt_tokens,
            "promoted_blocks": after.num_promoted_blocks - before.num_promoted_blocks,
            "demoted_blocks": after.num_demoted_blocks - before.num_demoted_blocks,
            "demote_seconds": round(after.demote_seconds - before.demote_seconds, 4),
            "disk_read_blocks": after.disk_read_blocks - before.disk_read_blocks}


def tier_kwargs(device_blocks: int, host_blocks: int, block_bytes: int, disk_path: str) -> dict:
    return {"num_blocks": device_blocks, "host_kv_cache_bytes": host_blocks * block_bytes,
            "disk_kv_cache_path": disk_path, "disk_kv_cache_bytes": 1 << 40, "disk_kv_min_free_bytes": 0}


def warm_restart(prompts: list[tuple[list[int], int]], kwargs: dict, groups: int, turns: int) -> dict[str, float]:
    """The last ``RESTART_REQUESTS`` prompts' hit rate after a kill and restart, over theirs without one."""
    first, last = prompts[:-RESTART_REQUESTS], prompts[-RESTART_REQUESTS:]
    with tempfile.TemporaryDirectory(prefix="pd-kv-tiers-") as path:
        steady = engine(**{**kwargs, "disk_kv_cache_path": path})
        serve(steady, first)
        before = serve(steady, last)
        steady.close()
    with tempfile.TemporaryDirectory(prefix="pd-kv-tiers-") as path:
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.kv_tiers", "--serve-then-wait", path, "--groups", str(groups), "--turns", str(turns),
             "--device-blocks", str(kwargs["num_blocks"]), "--host-bytes", str(kwargs["host_kv_cache_bytes"])],
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        try:
            while (line := child.stdout.readline()) and line.strip() != "served":
                pass  # NIXL logs to stdout too
            assert line, "the replica to kill exited before it served"
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        restarted = engine(**{**kwargs, "disk_kv_cache_path": path})
        after = serve(restarted, last)
        found = restarted.stats().disk_blocks
        restarted.close()
    return {"warm_restart_hit_ratio": round(after["hit_rate"] / before["hit_rate"], 3),
            "warm_restart_hit_rate_before": before["hit_rate"], "warm_restart_hit_rate_after": after["hit_rate"],
            "warm_restart_ttft_p50_before_s": before["ttft_p50_s"], "warm_restart_ttft_p50_after_s": after["ttft_p50_s"],
            "warm_restart_disk_blocks_found": found}


def serve_then_wait(path: str, groups: int, turns: int, device_blocks: int, host_bytes: int) -> None:
    """The replica that ``warm_restart`` kills: serve the first prompts, say so, wait to be killed."""
    prompts = chat_prompts(groups, turns)[:-RESTART_REQUESTS]
    llm = engine(num_blocks=device_blocks, host_kv_cache_bytes=host_bytes, disk_kv_cache_path=path,
                 disk_kv_cache_bytes=1 << 40, disk_kv_min_free_bytes=0)
    serve(llm, prompts)
    print("served", flush=True)
    sys.stdin.read()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-blocks", type=int, default=None,
                        help="default: a quarter of the workload's distinct blocks")
    parser.add_argument("--host-blocks", type=int, default=None, help="default: an eighth of the distinct blocks")
    parser.add_argument("--groups", type=int, default=2, help="groups of 16 conversations")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--serve-then-wait", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--host-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if 16 * args.groups * args.turns <= RESTART_REQUESTS:
        parser.error(f"--groups {args.groups} --turns {args.turns} give {16 * args.groups * args.turns} prompts; the "
                     f"warm restart replays the last {RESTART_REQUESTS} after the others, so it needs more")
    torch.set_num_threads(1)
    if args.serve_then_wait:
        serve_then_wait(args.serve_then_wait, args.groups, args.turns, args.device_blocks, args.host_bytes)
        return

    from pd.engine import kv_layout
    from pd.engine.kv_layout import kv_block_bytes
    from pd.model.config import load_model_config
    from pd.model.paths import resolve_model_path
    from pd.workload.host import cpu_name

    prompts = chat_prompts(args.groups, args.turns)
    model_config = load_model_config(resolve_model_path(MODEL))
    block_bytes = kv_block_bytes(model_config, BLOCK_SIZE, torch.float32)
    working_set = distinct_blocks(prompts)
    device_blocks = args.device_blocks or working_set // 4
    host_blocks = args.host_blocks or working_set // 8
    unbounded_blocks = sum(-(-len(ids) // BLOCK_SIZE) + 1 for ids, _ in prompts)
    with tempfile.TemporaryDirectory(prefix="pd-kv-tiers-") as path:
        tiered_kwargs = tier_kwargs(device_blocks, host_blocks, block_bytes, path)
        runs = {"device_only": serve(engine(num_blocks=device_blocks), prompts),
                "tiered": serve(tiered := engine(**tiered_kwargs), prompts),
                "unbounded": serve(engine(num_blocks=unbounded_blocks), prompts)}
        tiered.close()
    block_shape = kv_layout.block_shape(model_config.num_layers, BLOCK_SIZE, model_config.num_kv_heads,
                                        model_config.head_dim)
    large = {**tier_speeds.host_to_device(LLAMA3_8B_BLOCK, 64), **tier_speeds.disk_to_host(LLAMA3_8B_BLOCK, 64)}
    row = {
        "cpu": cpu_name(),
        **tier_speeds.host_to_device(block_shape, 1024), **tier_speeds.disk_to_host(block_shape, 1024),
        "llama3_8b_block": large,
        **{f"hit_rate_{name}": run["hit_rate"] for name, run in runs.items()},
        **{f"ttft_p50_{name}_s": run["ttft_p50_s"] for name, run in runs.items()},
        "tiered_vs_unbounded_hit_rate": round(runs["tiered"]["hit_rate"] / runs["unbounded"]["hit_rate"], 3),
        "device_only_vs_tiered_ttft_p50": round(runs["device_only"]["ttft_p50_s"] / runs["tiered"]["ttft_p50_s"], 3),
        **warm_restart(prompts, tiered_kwargs, args.groups, args.turns),
        "requests": len(prompts), "turns": args.turns, "prompt_tokens": runs["unbounded"]["prompt_tokens"],
        "working_set_blocks": working_set, "device_blocks": device_blocks, "host_blocks": host_blocks,
        "block_bytes": block_bytes, "promoted_blocks": runs["tiered"]["promoted_blocks"],
        **{key: runs["tiered"][key] for key in ("demoted_blocks", "demote_seconds")},
        "disk_read_blocks": runs["tiered"]["disk_read_blocks"], "model": MODEL,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
