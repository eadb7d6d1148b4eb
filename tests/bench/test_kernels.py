"""``bench.kernels``: the causal FLOP count its prefill TFLOP/s divide by."""

from __future__ import annotations

import torch

from bench.kernels import causal_attention_flops


def test_causal_flops_count_the_pairs_a_causal_mask_keeps():
    lens, heads, head_dim = [1, 5, 16], 3, 8
    pairs = sum(int(torch.ones(n, n).tril().sum()) for n in lens)
    assert causal_attention_flops(lens, heads, head_dim) == 4 * heads * head_dim * pairs  # QK^T and PV, 2 flops a MAC
    assert causal_attention_flops([8192], 32, 128) == 4 * 32 * 128 * 8192 * 8193 // 2
