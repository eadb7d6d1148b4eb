"""Expert parallelism on two ranks: balance under a skewed router, and what a live rebalance costs.

``python -m bench.ep [--hot-share 0.5] [--requests 16] [--max-tokens 48]``

The model is a Qwen3-MoE of 8 experts (2 a token) whose router is biased so
that experts 0 and 1 take ``--hot-share`` of the routed pairs: the embedding
gives every token one large feature, and only those two experts' gate rows
read it (the bias is bisected against HF's own router outputs).

- ``balance``: the same workload on EP=2 with the static placement (experts
  0-3 on rank 0, 4-7 on rank 1) and with EPLB's placement over 2 redundant
  experts after a rebalance. Per case: the balancedness (mean over max tokens
  per rank, from the load window), and per phase (``prefill``: 256-token
  prompts; ``decode``: streams of short prompts) the rows each rank's experts
  ran and the slowest rank's seconds in its experts, whose ratio between the
  cases is set against the balancedness ratio (in proportion, if the slowest
  rank's time follows its tokens).
- ``rebalance``: streams decoding on EP=2 while a rebalance moves the layers,
  ``eplb_moves_per_step`` experts before each step. Every decode step's time
  is every stream's inter-token gap: the worst in the round over the median
  outside it, the same for a window of as many steps outside the round (the
  host's own noise), the longest part of a move a step waited for, each
  layer's whole move, and one expert's bytes against a memory copy of them.

Each rank computes on one thread (``num_threads 1``): two ranks on two CPUs.
``two_rank_speedup_bound`` says how much of that is parallel here: one-thread
GEMMs alone and two at once, measured in the same run. Where it is near 1.0
(two vCPUs sharing one core's units), no placement can make the slowest rank
faster, only lighter: its rows are the work figure then.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import pd_kernels.cpu
from pd import LLM, SamplingParams
from pd.engine.ep.placement import balancedness, static_placement
from pd.workload.host import cpu_flags, cpu_name

EXPERTS, TOP_K, HOT = 8, 2, (0, 1)
SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, moe_intermediate_size=1024, num_experts=EXPERTS,
             num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=2048)
FEATURE = 4.0  # the embedding's extra feature, which the hot experts' gate rows read


def _model(bias: float):
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = FEATURE
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[:, 0] = 0.0
            gate[list(HOT), 0] = bias
    return model


def hot_share(model, prompts: list[list[int]]) -> float:
    """The hot experts' share of routed pairs, over every MoE layer, by HF's own router."""
    hot = total = 0
    with torch.no_grad():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), output_router_logits=True)
            for logits in out.router_logits:
                ids = logits.topk(TOP_K, dim=-1).indices
                hot += sum(int((ids == e).sum()) for e in HOT)
                total += ids.numel()
    return hot / total


def make_checkpoint(root: Path, share: float, prompts: list[list[int]]) -> tuple[Path, float]:
    """The biased model whose hot experts take about ``share`` of the pairs (bisected), and its share."""
    low, high = 0.0, 2.0
    for _ in range(12):
        mid = (low + high) / 2
        measured = hot_share(_model(mid), prompts[:4])
        low, high = (mid, high) if measured < share else (low, mid)
    model = _model((low + high) / 2)
    model.save_pretrained(root)
    return root, hot_share(model, prompts[:4])


def workload(num_requests: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]


def _settle(llm: LLM, prompt: list[int]) -> None:
    """One short request: carries a requested sync, or the rest of a rebalance round, through the steps."""
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))


def _work(llm: LLM, prompts, params, settle: list[int]) -> dict:
    """Each rank's expert rows and seconds over one run of ``prompts`` (the stats synced around it)."""
    def synced() -> dict:
        llm.engine.experts.sync()
        _settle(llm, settle)
        return llm.engine.experts.stats()

    before = synced()
    started = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    after = synced()
    rows = [a - b for a, b in zip(after["rank_expert_rows"], before["rank_expert_rows"])]
    expert_s = [a - b for a, b in zip(after["rank_expert_seconds"], before["rank_expert_seconds"])]
    return {"rank_expert_rows": rows, "rows_balancedness": statistics.mean(rows) / max(rows),
            "rank_expert_s": expert_s, "slowest_rank_expert_s": max(expert_s), "run_s": seconds}


def balance_case(path: Path, redundant: int, phases: dict, chunk: int) -> dict:
    """EP=2 with ``redundant`` experts (rebalanced from the load of a first run): balancedness, and each
    phase's expert work per rank (``phases``: name -> prompts, params)."""
    settle = next(iter(phases.values()))[0][0][:16]
    with LLM(str(path), expert_parallel_size=2, num_redundant_experts=redundant, num_threads=1, num_blocks=1024,
             max_num_batched_tokens=chunk, eplb_window_steps=4096) as llm:
        for prompts, params in phases.values():  # fills the load window, with other prompts (no prefix hits)
            llm.generate([[(t * 7 + 1) % SHAPE["vocab_size"] for t in p] for p in prompts], params)
        if redundant:
            llm.engine.experts.rebalance()
            _settle(llm, settle)
        out = {name: _work(llm, prompts, params, settle) for name, (prompts, params) in phases.items()}
        stats = llm.engine.experts.stats()
    static = [balancedness(static_placement(EXPERTS, 2).rank_loads([float(v) for v in load]))
              for load in stats["expert_load"].values()]
    return {"redundant_experts": redundant, "balancedness": statistics.mean(stats["balancedness"].values()),
            "balancedness_static_same_load": statistics.mean(static), **out}


_GEMM = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 1024)
for _ in range(3):
    a @ b
started = time.perf_counter()
for _ in range(200):
    a @ b
print(2 * 512 * 512 * 1024 * 200 / (time.perf_counter() - started) / 1e9)
"""


def host_concurrency() -> dict:
    """One-thread GEMM GFLOP/s alone and in two processes at once: what two ranks can compute side by side
    on this host (2.0 where its two CPUs are two cores' worth; near 1.0 where they share one's units)."""
    import subprocess
    import sys

    def run(copies: int) -> list[float]:
        procs = [subprocess.Popen([sys.executable, "-c", _GEMM], stdout=subprocess.PIPE, text=True)
                 for _ in range(copies)]
        return [float(p.communicate()[0]) for p in procs]

    [alone] = run(1)
    together = run(2)
    return {"gemm_gflops_alone": alone, "gemm_gflops_two_at_once": together,
            "two_rank_speedup_bound": sum(together) / alone}


def copy_seconds(num_bytes: int, repeats: int = 5) -> float:
    """A same-size memory copy on this host: the bound a layer's move over loopback is set against."""
    src = torch.empty(num_bytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def rebalance_case(path: Path, prompts, max_tokens: int, warm_steps: int) -> dict:
    """Streams decoding while a rebalance runs from step ``warm_steps``: every step's wall time, inside the
    round and outside it, and the longest part of a move any step waited for."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(str(path), expert_parallel_size=2, num_redundant_experts=2, num_threads=1, num_blocks=512,
             max_num_batched_tokens=512, eplb_window_steps=4096) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"stream-{i}", prompt, params)
        steps: list[tuple[float, bool]] = []  # (seconds, in the round) of each decode step
        while engine.has_unfinished_requests():
            if len(steps) == warm_steps:
                engine.experts.rebalance()
            in_round = engine.experts.schedule.in_round  # this step runs a part of the round
            started = time.perf_counter()
            outputs = engine.step()
            if outputs and all(len(o.new_token_ids) == 1 for o in outputs):  # every stream decoding
                steps.append((time.perf_counter() - started, in_round))
        stats = engine.experts.stats()
        layer = engine.runner.model.weights.layers[engine.runner.experts.moe_layers[0]].moe
        expert_bytes = (layer.w13[0].numel() + layer.w2[0].numel()) * layer.w13.element_size()
    steps = steps[1:]  # the first ends the prompts' prefill
    outside = [s for s, in_round in steps if not in_round]
    inside = [s for s, in_round in steps if in_round]
    median = statistics.median(outside)
    # The same number of consecutive steps outside the round, for the noise a step sees anyway.
    quiet = max(max(outside[i:i + len(inside)]) for i in range(0, max(1, len(outside) - len(inside))))
    moves = stats["move_seconds"]
    return {"median_step_s": median, "round_steps": len(inside), "worst_step_in_round_s": max(inside),
            "worst_over_median": max(inside) / median, "worst_outside_round_over_median": quiet / median,
            "move_part_max_s": stats["move_part_max_s"], "move_part_max_over_median": stats["move_part_max_s"] / median,
            "layers_moved": len(moves), "layer_move_s_median": statistics.median(moves) if moves else None,
            "expert_bytes": expert_bytes, "copy_s_one_expert": copy_seconds(expert_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hot-share", type=float, default=0.5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--warm-steps", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens of the balance runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = workload(args.requests, args.prompt_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    host = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "isa": pd_kernels.cpu.isa()}
    with tempfile.TemporaryDirectory() as tmp:
        path, share = make_checkpoint(Path(tmp) / "skewed-moe", args.hot_share, prompts)
        phases = {"prefill": (workload(args.requests, 256, seed=2), SamplingParams(max_tokens=1, temperature=0)),
                  "decode": (prompts, params)}
        static = balance_case(path, 0, phases, args.chunk)
        eplb = balance_case(path, 2, phases, args.chunk)
        print(json.dumps({"bench": "ep_balance", **host, **host_concurrency(), "hot_experts_share": share,
                          "static": static,
                          "eplb": eplb, "balancedness_ratio": eplb["balancedness"] / static["balancedness"],
                          **{f"{name}_slowest_rank_speedup": static[name]["slowest_rank_expert_s"]
                             / eplb[name]["slowest_rank_expert_s"] for name in phases},
                          **{f"{name}_slowest_rank_rows_ratio": max(static[name]["rank_expert_rows"])
                             / max(eplb[name]["rank_expert_rows"]) for name in phases}}))
        streams = workload(args.streams, args.prompt_len, seed=1)
        print(json.dumps({"bench": "ep_rebalance", **host, "streams": args.streams,
                          **rebalance_case(path, streams, args.max_tokens * 3, args.warm_steps)}))


if __name__ == "__main__":
    main()
