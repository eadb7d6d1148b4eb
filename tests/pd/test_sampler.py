"""``Sampler.draw``: the unseeded sampled rows of a step drawn together, each from its own distribution."""

from __future__ import annotations

import collections

import pytest
import torch

from pd.engine.request import Request
from pd.engine.sampler import CPU_TOGETHER_VOCAB, Sampler
from pd.sampling_params import SamplingParams


def requests_for(params: list[SamplingParams]) -> list[Request]:
    return [Request(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], sampling_params=p) for i, p in enumerate(params)]


def test_the_unseeded_sampled_rows_of_a_step_are_one_draw(monkeypatch):
    # A row at a time, a batch of 256 sampled rows cost ten small kernels a row on a GPU (and 53 ms a step at
    # a vocabulary of 512 on a CPU); the seeded rows keep their own generators, a draw each.
    calls = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.append(a[0].shape) or multinomial(*a, **k))
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20)] * 60 + [SamplingParams(temperature=0.7, seed=5)] * 2
    out = Sampler(0, torch.device("cpu")).draw(torch.randn(62, 100), requests_for(params)).read()
    assert calls == [(60, 100), (100,), (100,)]
    assert out.errors == {} and all(0 <= t < 100 for t in out.sampled_token_ids)


def test_a_cpu_draws_the_rows_of_a_real_vocabulary_one_at_a_time(monkeypatch):
    calls = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.append(a[0].shape) or multinomial(*a, **k))
    vocab = CPU_TOGETHER_VOCAB + 1
    out = Sampler(0, torch.device("cpu")).draw(torch.randn(3, vocab), requests_for([SamplingParams()] * 3)).read()
    assert calls == [(vocab,)] * 3 and out.errors == {}


def test_each_row_keeps_its_own_temperature_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    rows = {
        "plain": SamplingParams(temperature=1.0),
        "top_k_2": SamplingParams(temperature=1.0, top_k=2),
        "top_p": SamplingParams(temperature=1.0, top_p=0.8),  # 3.0 and 2.0 hold 0.90 of the mass: 0.665 first
        "cold": SamplingParams(temperature=0.05),
    }
    names = [name for name in rows for _ in range(2000)]
    requests = requests_for([rows[name] for name in names])
    out = Sampler(1, torch.device("cpu")).draw(logits.repeat(len(names), 1), requests).read()
    seen = collections.defaultdict(collections.Counter)
    for name, token in zip(names, out.sampled_token_ids):
        seen[name][token] += 1
    expected = torch.softmax(logits, dim=-1).tolist()
    for token, p in enumerate(expected):
        assert seen["plain"][token] / 2000 == pytest.approx(p, abs=0.035)
    assert set(seen["top_k_2"]) == {0, 1}
    assert seen["top_k_2"][0] / 2000 == pytest.approx(expected[0] / (expected[0] + expected[1]), abs=0.035)
    assert set(seen["top_p"]) == {0, 1}
    assert seen["cold"] == {0: 2000}


def test_a_row_that_cannot_be_drawn_fails_alone():
    # Finite logits that overflow once divided by a temperature just above greedy: no distribution is left.
    logits = torch.zeros(3, 8)
    logits[1, 2] = 3e38
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=2e-5), SamplingParams(temperature=0.9)]
    out = Sampler(0, torch.device("cpu")).draw(logits, requests_for(params)).read()
    assert set(out.errors) == {1} and "sampling failed" in out.errors[1]
    assert out.sampled_token_ids[1] is None and all(0 <= out.sampled_token_ids[row] < 8 for row in (0, 2))


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_step():
    seeded = SamplingParams(temperature=0.9, seed=42)
    logits = torch.randn(5, 50)
    alone = Sampler(0, torch.device("cpu")).draw(logits[2:3], requests_for([seeded])).read()
    mixed = requests_for([SamplingParams(temperature=0.5)] * 2 + [seeded] + [SamplingParams(temperature=0)] * 2)
    together = Sampler(7, torch.device("cpu")).draw(logits, mixed).read()
    assert together.sampled_token_ids[2] == alone.sampled_token_ids[0]


def _checked_multinomial(monkeypatch):
    """``torch.multinomial`` that refuses a distribution it could not draw from. A CPU raises for one at once; a GPU
    checks with a device-side assert, which ends the process's CUDA context: every request on the replica fails."""
    multinomial = torch.multinomial

    def checked(probs, *args, **kwargs):
        assert torch.isfinite(probs).all() and (probs >= 0).all() and (probs.sum(dim=-1) > 0).all(), probs
        return multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", checked)


@pytest.mark.parametrize("seed", [None, 3], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("vocab", [8, CPU_TOGETHER_VOCAB + 1], ids=["together", "per-row"])
def test_no_draw_is_asked_of_a_row_without_a_distribution(monkeypatch, seed, vocab):
    _checked_multinomial(monkeypatch)
    logits = torch.zeros(3, vocab)
    logits[1, 2] = 3e38  # finite, and infinite once divided by its temperature
    params = [SamplingParams(temperature=0.9, seed=seed), SamplingParams(temperature=2e-5, seed=seed),
              SamplingParams(temperature=0.9, seed=seed)]
    out = Sampler(0, torch.device("cpu")).draw(logits, requests_for(params)).read()
    assert set(out.errors) == {1} and "no token is left" in out.errors[1]
    assert out.sampled_token_ids[1] is None and all(0 <= out.sampled_token_ids[row] < vocab for row in (0, 2))
