"""Random peft LoRA adapters for tests, written by peft's own ``save_pretrained``, and their HF references."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from tests.reference import hf_greedy

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# peft starts B at zero (a no-op adapter); random A and B of this std against the tiny checkpoints' weights of
# std 0.1 (``tests.checkpoints``) move the deltas to about half the base weights: greedy tokens change.
INIT_SCALE = 0.1


def make_adapter(base_checkpoint_dir: Path, out_dir: Path, *, r: int = 8, alpha: float = 16,
                 target_modules: Sequence[str] = ALL_MODULES, use_rslora: bool = False,
                 rank_pattern: Mapping[str, int] | None = None, alpha_pattern: Mapping[str, float] | None = None,
                 seed: int = 0, init_scale: float = INIT_SCALE) -> Path:
    """Write a random LoRA adapter for the checkpoint at ``base_checkpoint_dir`` to ``out_dir`` and return it.

    peft builds it (``LoraConfig`` + ``get_peft_model``), every ``lora_A`` and ``lora_B`` is then drawn from
    a normal of std ``init_scale`` (seeded), and peft saves it.
    """
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_checkpoint_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                             rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
                             lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * init_scale)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def hf_model_with_adapter(base_dir: Path, adapter_dir: Path | None):
    """HF ``transformers`` in fp32 on the base checkpoint, under peft's adapter at ``adapter_dir`` (if any)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    import peft

    return peft.PeftModel.from_pretrained(model, adapter_dir).eval()


def hf_peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts_token_ids: Sequence[Sequence[int]],
                   max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """For each prompt, HF+peft's fp32 greedy tokens and the top-2 logit gap at each step (``tests.reference``'s
    near-tie rule); ``adapter_dir`` None: the base model alone."""
    model = hf_model_with_adapter(base_dir, adapter_dir)
    return [hf_greedy(model, list(prompt), max_new_tokens) for prompt in prompts_token_ids]
