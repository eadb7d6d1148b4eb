"""``bench.fp8_gemm``: the 8B layer's products, as the issue names them."""

from __future__ import annotations

import json

from bench import fp8_gemm
from bench.random_models import SHAPES


def test_the_products_are_the_8b_layers_fused_ones():
    assert fp8_gemm.layer_products(SHAPES["llama3-8b"]) == [
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
    assert fp8_gemm.gemm_flops(16, 6144, 4096) == 2 * 16 * 6144 * 4096


def test_without_cuda_it_says_it_was_skipped(capsys, monkeypatch):
    monkeypatch.setattr(fp8_gemm.torch.cuda, "is_available", lambda: False)
    fp8_gemm.main()
    assert json.loads(capsys.readouterr().out)["skipped"] == "no CUDA device"
