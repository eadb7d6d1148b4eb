"""Comparing greedy outputs with a reference, forgiving only near-ties; HF's reading of a GGUF, kept."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

import torch

NEAR_TIE = 1e-4


def hf_greedy(model, prompt: list[int], max_new_tokens: int):
    """HF greedy tokens and the top-2 logit gap at each step."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, eos_token_id=None,
            do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, "reference stopped early"
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return tokens, gaps


def greedy_references(checkpoint, hf_model, prompts: list[list[int]], max_new_tokens: int):
    """``get(kind)``: HF's greedy tokens and top-2 gaps for each of ``prompts`` on checkpoint ``kind``, cached."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = hf_model(checkpoint(kind))
            cache[kind] = [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]
        return cache[kind]

    return get


def assert_greedy_match(ours: list[int], reference: list[int], gaps: list[float]) -> None:
    """Equal, or first diverging only where the reference's top-2 gap is a near-tie."""
    assert len(ours) == len(reference), (ours, reference)
    for step, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            assert gaps[step] < NEAR_TIE, f"diverged at step {step} with a top-2 gap of {gaps[step]:.2e}: {ours} vs {reference}"
            return


def teacher_forced_divergence(ours: list[int], model, prompt: list[int]) -> str | None:
    """Why ``ours`` is not HF's greedy continuation of ``prompt``, or None if it is.

    Teacher-forced on ours, HF's argmax must be our token at every step, up to a first divergence at a
    near-tie (a top-2 logit gap below ``NEAR_TIE`` in HF's logits), after which the continuations differ.
    """
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1]
    for step, token in enumerate(ours):
        top = logits[step].topk(2)
        if int(top.indices[0]) != token:
            gap = float(top.values[0] - top.values[1])
            return None if gap < NEAR_TIE else f"step {step}: ours {token}, HF {int(top.indices[0])} (gap {gap:.2e})"
    return None


def hf_from_gguf(gguf: Path):
    """``(model, tokenizer)``: HF ``transformers`` reading a GGUF itself (its own dequantizer), in fp32.

    HF takes about 28 s on two cores to read the shipped SmolLM2's, so its result is kept, as HF saves a
    model, under the user's cache (keyed by the file and HF's version) and read from there by every later
    process: the pytest workers and the Serve tests, in about 0.5 s. A lock makes one process read the GGUF.
    """
    import transformers

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode())
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    cached = home / "pd" / "hf-from-gguf" / key.hexdigest()[:16]
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.parent / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cached / "config.json").is_file():
            model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                      dtype=torch.float32)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model.hf_quantizer = None  # the GGUF reader's marker: the weights are plain fp32 tensors by now
            staging = Path(tempfile.mkdtemp(dir=cached.parent))
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(cached)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(cached))
