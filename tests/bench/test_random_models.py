"""``bench.random_models``: seeded shapes, and a cache entry built once and then read back."""

from __future__ import annotations

import pytest
import torch

from bench import random_models


def test_a_cache_entry_is_built_once_then_read_back(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv(random_models.CACHE_ENV, str(tmp_path))
    (tmp_path / "tiny-llama-2l.scratch-1").mkdir()  # a build killed halfway
    path, built = random_models.cached_checkpoint("tiny-llama", 2, device="cpu")
    assert built is not None and path == tmp_path / "tiny-llama-2l"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama-2l"]  # its scratch gone, no other left
    again, model = random_models.load_cached("tiny-llama", 2, device="cpu")
    assert again == path
    for (name, expected), (_, actual) in zip(built.state_dict().items(), model.state_dict().items()):
        assert actual.dtype == torch.bfloat16
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)


def test_the_same_seed_builds_the_same_weights_and_keeps_rotary_frequencies_in_fp32():
    pytest.importorskip("transformers")
    first, second = (random_models.build_model("tiny-moe", 1, "cpu") for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert next(first.parameters()).dtype == torch.bfloat16
    assert first.model.rotary_emb.inv_freq.dtype == torch.float32


def test_the_shapes_head_dims():
    assert random_models.SHAPES["llama3-8b"].head_dim == 128
    assert random_models.SHAPES["qwen3-30b-a3b"].head_dim == 128  # named, not hidden / heads (64)
