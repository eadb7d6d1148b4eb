"""``bench.fp32_reference``: ours and HF bf16 against HF fp32, teacher-forced, on the CPU at tiny shapes."""

from __future__ import annotations

import json

import pytest
import torch

from bench import fp32_reference
from bench.fp32_reference import Scores, compare


def test_compare_takes_the_median_and_p99_of_the_absolute_differences_and_top1_where_confident():
    truth = Scores(chosen=torch.zeros(2, 50), top1=torch.zeros(2, 50, dtype=torch.int64))
    delta = torch.arange(100, dtype=torch.float32).view(2, 50) / 100  # 0.00 .. 0.99
    top1 = torch.zeros(2, 50, dtype=torch.int64)
    top1[0, :10] = 7  # ten disagreements, five of them at confident positions
    gap = torch.full((2, 50), 0.5)
    gap[0, :5] = 0.05
    result = compare(truth, gap, Scores(chosen=-delta, top1=top1))
    assert result["p50"] == pytest.approx(0.495)
    assert result["p99"] == pytest.approx(0.9801)
    assert result["max"] == pytest.approx(0.99)
    assert result["top1_confident"] == pytest.approx(90 / 95, abs=1e-4)


def test_compare_refuses_scores_of_another_shape():
    truth = Scores(chosen=torch.zeros(2, 5), top1=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        compare(truth, torch.ones(2, 5), Scores(chosen=torch.zeros(2, 4), top1=torch.zeros(2, 4, dtype=torch.int64)))


def test_sharpen_scales_the_lm_head_and_the_routers_only():
    pytest.importorskip("transformers")
    from bench.random_models import build_model

    model = build_model("tiny-moe", 1, "cpu", torch.float32)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    fp32_reference.sharpen(model)
    for name, param in model.named_parameters():
        scale = (fp32_reference.LM_HEAD_SCALE if name == "lm_head.weight"
                 else fp32_reference.ROUTER_SCALE if name.endswith("mlp.gate.weight") else 1.0)
        torch.testing.assert_close(param, before[name] * scale, rtol=0, atol=0, msg=name)
    assert any(name.endswith("mlp.gate.weight") for name in before)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_a_tiny_model_on_the_cpu_reports_both_bf16_models_against_fp32(model, capsys):
    pytest.importorskip("transformers")
    fp32_reference.main(["--model", model, "--layers", "2", "--device", "cpu", "--batch", "3", "--prompt-len", "12",
                         "--new-tokens", "8"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["case"] == "fp32_reference" and record["device"] == "cpu"
    assert record["positions"] == 3 * (12 + 8 - 1) and 0 < record["confident_positions"] <= record["positions"]
    for who in ("ours_bf16", "hf_bf16"):
        stats = record[who]
        assert 0 < stats["p50"] <= stats["p99"] <= stats["max"] < 0.5, who  # bf16's rounding: small, never zero
        assert stats["top1_confident"] >= 0.9, who
    assert record["ours_over_hf_p50"] > 0


def test_a_gpu_sized_model_on_the_cpu_is_skipped_with_a_reason(capsys):
    fp32_reference.main(["--model", "llama3-8b", "--device", "cpu"])
    assert "GPU-sized" in json.loads(capsys.readouterr().out)["skipped"]
