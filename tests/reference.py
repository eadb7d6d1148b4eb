"""Comparing greedy outputs with a reference, forgiving only near-ties."""

from __future__ import annotations

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
