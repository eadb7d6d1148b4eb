"""Decode steps with LoRA adapters against the same batch on the base model alone, in the same run.

``python -m bench.lora_decode [--batch 32] [--adapters 4] [--rank 16] [--prompt-tokens 64] [--max-tokens 48]
[--rounds 3] [--threads 2]`` prints one JSON line per case, on the trained default model with random
adapters of rank ``rank`` on every attention and MLP projection (written in peft's format, read by
``pd.lora.adapter`` as any adapter is):

- ``plain``: an engine without ``enable_lora``, the batch on the base model: the reference;
- ``base_rows``: an engine with ``enable_lora``, the same batch on the base model (no row has an adapter:
  the step adds no delta);
- ``adapters``: the batch spread evenly over ``adapters`` adapters;
- ``mixed``: half the batch on the base model, half over the adapters.

Each case adds ``batch`` requests together and steps until they finish; a step is a decode step when every
request of the batch took one token in it (all prompts done). ``step_s_p50`` is the median of those steps'
seconds over ``rounds`` rounds, the cases' rounds interleaved so that a burst of other work on the host
lands on all of them; ``tok_s`` is ``batch / step_s_p50`` and ``vs_plain`` its ratio to ``plain``'s.
``outputs_equal_plain``: for ``base_rows``, whether every request's tokens are ``plain``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pd import LLM, LoRARequest, SamplingParams
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.workload.host import cpu_flags, cpu_name

MODEL = "builtin:smollm2-135m-instruct"
MODULES = {"q_proj": ("hidden", "q"), "k_proj": ("hidden", "kv"), "v_proj": ("hidden", "kv"),
           "o_proj": ("q", "hidden"), "gate_proj": ("hidden", "inter"), "up_proj": ("hidden", "inter"),
           "down_proj": ("inter", "hidden")}
CASES = ("plain", "base_rows", "adapters", "mixed")


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A random adapter of ``rank`` on every attention and MLP projection, as peft saves one."""
    config = load_model_config(model_dir)
    sizes = {"hidden": config.hidden_size, "q": config.q_size, "kv": config.kv_size,
             "inter": config.intermediate_size}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in MODULES.items():
            part = "self_attn" if module[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, sizes[fan_in], generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(sizes[fan_out], rank, generator=generator) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(MODULES),
        "bias": "none", "task_type": "CAUSAL_LM"}))
    return out


def run_case(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
             params: SamplingParams) -> tuple[list[float], list[list[int]]]:
    """The batch's decode steps' seconds, and each request's tokens."""
    engine = llm.engine
    ids = [f"lora-bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(request_id, prompt, params, lora=lora)
    tokens = {request_id: [] for request_id in ids}
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        if len(outputs) == len(prompts) and all(len(o.new_token_ids) == 1 for o in outputs) \
                and all(len(t) > 1 for t in tokens.values()):
            steps.append(seconds)
    return steps, [tokens[request_id] for request_id in ids]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    model_dir = resolve_model_path(args.model)
    vocab = load_model_config(model_dir).vocab_size
    prompts = [[(97 * i + 13 * j) % (vocab - 1) + 1 for j in range(args.prompt_tokens)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    options = {"dtype": "float32", "num_threads": args.threads, "max_num_seqs": args.batch,
               "max_num_batched_tokens": max(2048, args.batch)}
    with tempfile.TemporaryDirectory() as root:
        adapters = [LoRARequest(f"bench-{i}", str(write_adapter(model_dir, Path(root) / f"a{i}", args.rank, i)))
                    for i in range(args.adapters)]
        loras = {"plain": [None] * args.batch, "base_rows": [None] * args.batch,
                 "adapters": [adapters[i % len(adapters)] for i in range(args.batch)],
                 "mixed": [None if i % 2 == 0 else adapters[(i // 2) % len(adapters)] for i in range(args.batch)]}
        plain = LLM(args.model, **options)
        lora = LLM(args.model, **options, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
        engines = {"plain": plain, "base_rows": lora, "adapters": lora, "mixed": lora}
        steps: dict[str, list[float]] = {case: [] for case in CASES}
        outputs: dict[str, list[list[int]]] = {}
        load_before = os.getloadavg()[0]
        for _ in range(args.rounds):
            for case in CASES:
                case_steps, outputs[case] = run_case(engines[case], prompts, loras[case], params)
                steps[case].extend(case_steps)
        host_load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        plain.close()
        lora.close()
    plain_tok_s = args.batch / statistics.median(steps["plain"])
    for case in CASES:
        step_s = statistics.median(steps[case])
        line = {"bench": "lora_decode", "case": case, "batch": args.batch, "adapters": args.adapters,
                "rank": args.rank, "num_steps": len(steps[case]), "step_s_p50": round(step_s, 5),
                "tok_s": round(args.batch / step_s, 1), "vs_plain": round(args.batch / step_s / plain_tok_s, 3),
                "model": args.model, "threads": args.threads, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
                "isa": _isa(), "host_load": host_load}
        if case == "base_rows":
            line["outputs_equal_plain"] = outputs[case] == outputs["plain"]
        print(json.dumps(line), flush=True)


def _isa() -> str:
    import pd_kernels.cpu

    return pd_kernels.cpu.isa()


if __name__ == "__main__":
    main()
