"""What an FP8 KV cache and INT8 W8A8 weights cost on the trained SmolLM2-135M, teacher-forced.

A guard at the levels measured (``bench.quant_accuracy``, 2,560 tokens: FP8 e4m3 KV 0.951 top-1
agreement and KL 8.5e-3, INT8 W8A8 0.885 and 3.4e-2), over a shorter text here; the issue's goals
(0.99 and 1e-3, 0.97 and 5e-3) are above what bf16 itself keeps on this text (0.967, 1.4e-3), see
docs/quantization.md. A kernel or scale regression shows as a fall well below these.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.quant_accuracy import compare, position_logits, varied_text, windows_of
from pd.config import EngineConfig
from pd.model.paths import resolve_model_path
from pd.model.quantize import SCHEMES, quantize_checkpoint
from pd.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # a trained 135M model, three teacher-forced passes

WINDOW, TOKENS = 512, 1024


@pytest.fixture(scope="module")
def reference():
    source = resolve_model_path("builtin:smollm2-135m-instruct")
    config = EngineConfig(model=str(source), num_blocks=-(-(WINDOW + 1) // 16) + 1, block_size=16, dtype="float32")
    token_ids = Tokenizer.from_dir(source).encode(varied_text(), add_special_tokens=False)
    windows = windows_of(token_ids, TOKENS, WINDOW)
    targets = torch.tensor([t for w in windows for t in w[1:]])
    keep = torch.tensor([i < len(w) - 1 for w in windows for i in range(len(w))])
    return config, windows, targets, keep, position_logits(config, windows)[keep]


def test_an_fp8_kv_cache_keeps_the_measured_agreement(reference):
    config, windows, targets, keep, base = reference
    result = compare(base, position_logits(dataclasses.replace(config, kv_cache_dtype="fp8_e4m3"), windows)[keep],
                     targets)
    assert result["top1_agreement"] >= 0.93 and result["mean_kl"] <= 1.5e-2, result


def test_int8_weights_keep_the_measured_agreement(reference, tmp_path):
    config, windows, targets, keep, base = reference
    quantize_checkpoint(config.model, tmp_path / "int8", SCHEMES["int8"])
    result = compare(base, position_logits(dataclasses.replace(config, model=str(tmp_path / "int8")), windows)[keep],
                     targets)
    assert result["top1_agreement"] >= 0.85 and result["mean_kl"] <= 5e-2, result
