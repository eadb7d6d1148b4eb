"""``bench.engine`` on a tiny DeepSeek-V2-Lite-shaped model: ours against HF generate, and MLA's bound."""

from __future__ import annotations

import json

import pytest

from bench import engine

# V2-Lite's structure (full-rank query, a dense first layer, 2 shared experts, greedy routing, YaRN) at
# widths a test runs in seconds; the latent (32 + 16) and value widths are the C++ kernel's multiples.
TINY = dict(engine.MODELS["v2lite"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            vocab_size=512, max_position_embeddings=4096)


@pytest.mark.slow  # two models through a whole benchmark, HF's and ours: the full tier
def test_the_v2_lite_shape_runs_ours_against_hf_and_reports_the_host(capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setitem(engine.MODELS, "v2lite_tiny", TINY)
    monkeypatch.setattr(engine, "measure_peaks", lambda: (50e9, 5e9))  # not seconds of 2048^3 matmuls
    engine.main(["--models", "v2lite_tiny", "--cases", "single,uniform", "--repeats", "1", "--vllm", "off"])
    peaks, *rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert peaks["case"] == "peaks" and peaks["cpu"] and peaks["isa"] in ("AVX512", "AVX2", "DEFAULT")
    assert (peaks["matmul_gflops"], peaks["copy_gb_s"]) == (50.0, 5.0)
    assert [(row["case"], row["model"], row["dtype"]) for row in rows] == [
        ("single", "v2lite_tiny", "float32"), ("uniform", "v2lite_tiny", "float32")]
    for row in rows:
        assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["hf_tok_s"], rel=0.01)
        assert 0 < row["roofline_frac"] < 1 and 0 < row["hf_roofline_frac"] < 1
        assert row["attention_backend"] in ("cpu", "torch") and row["hf_experts"] in ("eager", "grouped_mm")
        assert "vllm_tok_s" not in row


def test_the_bound_counts_the_checkpoints_layer_parameters(tmp_path, monkeypatch):
    """Every routed expert touched (a huge batch): the bound's parameters are the checkpoint's, less the
    embedding, the LM head and the norms; one token multiplies its top-k routed experts of them."""
    pytest.importorskip("transformers")
    import transformers

    monkeypatch.setitem(engine.MODELS, "v2lite_tiny", TINY)
    model = transformers.AutoModelForCausalLM.from_pretrained(engine.make_checkpoint("v2lite_tiny", tmp_path))
    layers = sum(p.numel() for name, p in model.named_parameters()
                 if ".layers." in name and "norm" not in name)
    assert engine.params_per_token(TINY, batch=10**6) == pytest.approx(layers)
    unused = (TINY["n_routed_experts"] - TINY["num_experts_per_tok"]) * 3 * 64 * TINY["moe_intermediate_size"]
    assert engine.params_per_token(TINY) == pytest.approx(layers - unused)  # one MoE layer
    assert engine.attention_costs(TINY)[1:] == (2 * 4 * (16 + 16 + 16), 32 + 16)  # decompressed pair, latent row
