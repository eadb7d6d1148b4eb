"""Equality against fp32: our bf16 engine, and HF in bf16 as the yardstick, each against HF in fp32.

``python -m bench.fp32_reference [--model llama3-8b] [--layers 8]`` builds a random model of a
``bench.random_models`` shape in bf16, so that every weight is bf16-representable, with its LM head scaled
4x and (MoE) its routers 8x: at random init the next-token distributions are near-flat and the expert
choice a coin toss, and scaled they have confident positions and decisive routes, as a trained model's
are. Three models read those same weights:

- the truth: HF in fp32, with TF32 off (every fp32 product in IEEE fp32);
- ours: our engine in bf16, on the checkpoint saved from the bf16 model;
- the yardstick: HF in bf16, its rotary frequencies in fp32 as ``from_pretrained`` leaves them.

``--batch`` random prompts of ``--prompt-len`` tokens, each continued by the truth's greedy
``--new-tokens``, are scored teacher-forced: at every position, the log-probability each model gives the
sequence's next token (ours: the engine's own prompt scores, ``SamplingParams(prompt_logprobs=1)``).
Prints one JSON line: for ours and for HF bf16, the median, p99 and max of |delta log p| against fp32,
and top-1 agreement with fp32 at its confident positions (top-2 gap >= 0.1 nats: below that a rounding
may rightly flip the choice). ``--device cpu`` runs a tiny shape (``tiny-llama``, ``tiny-moe``) in seconds;
a GPU-sized shape without CUDA prints one line saying it was skipped.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.random_models import SHAPES, build_model
from pd.workload.stats import percentiles

LM_HEAD_SCALE = 4.0
ROUTER_SCALE = 8.0  # powers of two: the scaled bf16 weights are exact
CONFIDENT_GAP = 0.1  # nats between fp32's top two tokens
CPU_SHAPES = ("tiny-llama", "tiny-moe")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Scores:
    """One model's teacher-forced scores of ``seqs [batch, length]``: position t predicts token t + 1."""

    chosen: torch.Tensor  # fp32 [batch, length - 1]: log p of the sequence's next token
    top1: torch.Tensor  # int64 [batch, length - 1]: the model's most likely token there


def sharpen(model) -> None:
    """Scale the LM head, and an MoE's routers, in place (see the module's doc)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(ROUTER_SCALE)


def greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prompts [batch, prompt_len]`` continued by ``model``'s greedy tokens: ``[batch, prompt_len + new_tokens]``."""
    with torch.inference_mode():
        return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def hf_scores(model, seqs: torch.Tensor) -> tuple[Scores, torch.Tensor]:
    """HF's scores of ``seqs`` on the CPU, and its top-2 gap at each position (fp32 ``[batch, length - 1]``)."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(seqs).logits[:, :-1].float(), dim=-1)
        chosen = logprobs.gather(-1, seqs[:, 1:, None]).squeeze(-1)
        top2 = logprobs.topk(2, dim=-1)
        gap = top2.values[..., 0] - top2.values[..., 1]
        return Scores(chosen.cpu(), top2.indices[..., 0].cpu()), gap.cpu()


def our_scores(path: Path, seqs: torch.Tensor, device: str) -> Scores:
    """Our engine's scores of ``seqs`` (bf16, its prompt log-probabilities), on the CPU."""
    from pd import LLM, SamplingParams

    batch, length = seqs.shape
    num_blocks = batch * -(-length // BLOCK_SIZE) + 1  # every sequence's KV at once, no more: the part shares the GPU
    llm = LLM(str(path), dtype="bfloat16", device=device, num_blocks=num_blocks, block_size=BLOCK_SIZE,
              cuda_graphs=False)
    try:
        outputs = llm.generate(seqs.tolist(), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    finally:
        llm.close()
    chosen = torch.tensor([[entry.logprob for entry in out.prompt_logprobs] for out in outputs])
    top1 = torch.tensor([[entry.top.token_ids[0] for entry in out.prompt_logprobs] for out in outputs])
    return Scores(chosen, top1)


def compare(truth: Scores, gap: torch.Tensor, other: Scores) -> dict:
    """|delta log p| of ``other`` against ``truth`` (median, p99, max), and top-1 agreement where ``gap``
    >= ``CONFIDENT_GAP``."""
    if other.chosen.shape != truth.chosen.shape:
        raise ValueError(f"scores of shape {tuple(other.chosen.shape)} against {tuple(truth.chosen.shape)}")
    delta = (other.chosen.double() - truth.chosen.double()).abs().flatten()
    p50, p99 = percentiles(delta.tolist(), [50, 99])
    confident = gap >= CONFIDENT_GAP
    agree = int(((other.top1 == truth.top1) & confident).sum())
    return {"p50": round(p50, 5), "p99": round(p99, 5), "max": round(float(delta.max()), 5),
            "top1_confident": round(agree / max(1, int(confident.sum())), 4)}


def measure(model: str, num_layers: int, batch: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    started = time.monotonic()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf16 = build_model(model, num_layers, device)
    sharpen(hf16)
    hf32 = copy.deepcopy(hf16).float()  # its fp32 rotary frequencies stay as they are
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, SHAPES[model].vocab_size - 1, (batch, prompt_len), generator=generator)
    seqs = greedy(hf32, prompts.to(device), new_tokens)
    truth, gap = hf_scores(hf32, seqs)
    del hf32
    yardstick, _ = hf_scores(hf16, seqs)
    with tempfile.TemporaryDirectory() as root:
        hf16.save_pretrained(root)
        del hf16
        if device == "cuda":
            torch.cuda.empty_cache()
        ours = our_scores(Path(root), seqs.cpu(), device)
    ours_vs, hf_vs = compare(truth, gap, ours), compare(truth, gap, yardstick)
    return {
        "case": "fp32_reference", "model": model, "layers": num_layers, "batch": batch, "prompt_len": prompt_len,
        "new_tokens": new_tokens, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "positions": truth.chosen.numel(), "confident_positions": int((gap >= CONFIDENT_GAP).sum()),
        "ours_bf16": ours_vs, "hf_bf16": hf_vs,
        "ours_over_hf_p50": round(ours_vs["p50"] / hf_vs["p50"], 3) if hf_vs["p50"] else None,
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"case": "fp32_reference", "skipped": "no CUDA device"}), flush=True)
        return
    if args.device == "cpu" and args.model not in CPU_SHAPES:
        print(json.dumps({"case": "fp32_reference", "skipped": f"{args.model} is GPU-sized; on the CPU run one of "
                                                                f"{CPU_SHAPES}"}), flush=True)
        return
    print(json.dumps(measure(args.model, args.layers, args.batch, args.prompt_len, args.new_tokens, args.device)),
          flush=True)


if __name__ == "__main__":
    main()
