"""Verification keeps the target distribution, and the speculator drafts only where drafts pay."""

from __future__ import annotations

import torch

from pd.engine.request import Request, RequestStatus
from pd.engine.sampler import Sampler
from pd.engine.spec.config import SpeculativeConfig
from pd.engine.spec.speculator import MIN_FIT_STEPS, Speculator
from pd.engine.spec.verify import verified_rows
from pd.sampling_params import SamplingParams
from router.step_cost import StepShape, StepSums

TRIALS = 6000


def test_rejection_sampling_approximates_the_target_distribution_not_the_drafts():
    """vLLM's test, for one-hot drafts: drafts from ``q``, verified against ``p``; the tokens output at the
    first and the second position follow ``p``, and drafts are accepted at the rate sum_x q(x) p(x)."""
    generator = torch.Generator().manual_seed(0)
    vocab = 5
    target_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = torch.softmax(target_logits, dim=0)
    q = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.6])  # far from p: mostly the target's least likely tokens
    drafts = torch.multinomial(q, 2 * TRIALS, replacement=True, generator=generator).view(TRIALS, 2).tolist()
    request = Request("r", [1], SamplingParams(temperature=1.0, max_tokens=8))
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    logits = target_logits.expand(3 * TRIALS, vocab).contiguous()  # each group: two drafts and the bonus row
    sampled = sampler.draw(logits, [request] * (3 * TRIALS), offsets=[0, 1, 2] * TRIALS).read().sampled_token_ids
    first, second, accepted = torch.zeros(vocab), torch.zeros(vocab), 0
    for trial, group in enumerate(drafts):
        rows = verified_rows(sampled, group, 3 * trial)
        first[sampled[rows[0]]] += 1
        accepted += sampled[rows[0]] == group[0]
        if len(rows) > 1:  # the second position is reached only through an accepted first draft
            second[sampled[rows[1]]] += 1
    assert (first / TRIALS - p).abs().sum() < 0.04  # total variation: the target's
    assert (first / TRIALS - q).abs().sum() > 0.8  # and not the drafts'
    assert abs(accepted / TRIALS - float((p * q).sum())) < 0.02
    assert (second / second.sum() - p).abs().sum() < 0.15  # fewer samples: a looser bound


def _decoding(request_id: str, context: int) -> Request:
    request = Request(request_id, list(range(context)), SamplingParams(max_tokens=64, temperature=0))
    request.append_output(7, None)
    request.status, request.num_computed_tokens = RequestStatus.RUNNING, request.num_tokens - 1
    return request


class Always:
    """Drafts four tokens for any request."""

    def propose(self, request_id, token_ids, k):
        return [1, 2, 3, 4][:k]

    def finish(self, request_id, token_ids, num_prompt_tokens):
        pass


def _fitted(base_s: float, per_token_s: float) -> StepSums:
    """Step sums of decode and verify steps (a logits row per token) of varied batches that took exactly
    ``base_s + per_token_s * tokens``."""
    sums = StepSums()
    for step in range(MIN_FIT_STEPS + 8):
        seqs = 1 + step % 5
        tokens = seqs + step % 7
        sums.record(StepShape(num_tokens=tokens, attn_pairs=0, num_seqs=seqs, num_samples=tokens),
                    base_s + per_token_s * tokens)
    return sums


def test_drafts_pay_at_batch_one_on_a_bandwidth_bound_step_and_back_off_at_saturation():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    # Weights-bound: a step costs 20 ms, a token 0.2 ms more. One request drafts all four.
    light = Speculator(config, _fitted(0.020, 0.0002), max_model_len=4096, proposer=Always())
    one = [_decoding("a", 100)]
    assert light.plan(one) == {one[0]: (1, 2, 3, 4)}
    # Compute-bound: each token costs 2 ms. With 64 decodes a step yields 64 tokens in 133 ms; a draft
    # accepted half the time adds its token at far less than that rate: nobody drafts.
    heavy = Speculator(config, _fitted(0.005, 0.002), max_model_len=4096, proposer=Always())
    batch = [_decoding(f"r{i}", 100) for i in range(64)]
    assert heavy.plan(batch) == {}
    # Without the back-off every request drafts at any load.
    always = Speculator(SpeculativeConfig(method="ngram", backoff=False), _fitted(0.005, 0.002), 4096, Always())
    assert len(always.plan(batch)) == 64


def test_a_request_whose_drafts_keep_failing_stops_drafting_and_probes_again_later():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    speculator = Speculator(config, _fitted(0.020, 0.004), max_model_len=4096, proposer=Always())
    request = _decoding("a", 100)
    assert speculator.plan([request])
    for _ in range(20):
        speculator.observe(request, 4, 0)  # every first draft rejected
    plans = [bool(speculator.plan([request])) for _ in range(60)]
    assert not plans[0]  # backed off
    assert any(plans)  # and probed again, once its estimate drifted back
    assert request.num_spec_draft_tokens == 80 and request.num_spec_accepted_tokens == 0
    assert speculator.counters.spec_num_drafts == 20


class Some:
    """Drafts two tokens for request "a" only."""

    def propose(self, request_id, token_ids, k):
        return [5, 6] if request_id == "a" else []

    def finish(self, request_id, token_ids, num_prompt_tokens):
        pass


def test_where_graphs_replay_every_eligible_request_drafts_the_full_length():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, backoff=False)
    speculator = Speculator(config, StepSums(), max_model_len=4096, proposer=Some())
    a, b = _decoding("a", 10), _decoding("b", 10)
    assert speculator.plan([a, b]) == {a: (5, 6)}
    speculator.uniform = True  # verify steps of k + 1 tokens a sequence replay a graph
    assert speculator.plan([a, b]) == {a: (5, 6, 6, 6), b: (7, 7, 7, 7)}


class OnlyFirst:
    """Drafts four tokens for request "r0" only: a lookup that finds little, as on open chat."""

    def propose(self, request_id, token_ids, k):
        return [1, 2, 3, 4][:k] if request_id == "r0" else []

    def finish(self, request_id, token_ids, num_prompt_tokens):
        pass


def test_a_measured_jump_in_step_time_stops_drafts_the_linear_law_would_take():
    """On a CPU a step past 8 rows leaves the few-row kernel: measured at context 100 on a 2-core Xeon,
    30.3 ms for 8 decodes, 36.2 ms with one draft more, then 0.8 ms a row. In a batch of 8 where one lookup
    finds drafts, verifying them costs the jump for at most two expected tokens: none are taken, where the
    linear law alone takes them. One request alone still drafts."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    speculator = Speculator(config, _fitted(0.020, 0.0002), max_model_len=4096, proposer=OnlyFirst())
    batch = [_decoding(f"r{i}", 100) for i in range(8)]
    assert speculator.plan(batch)  # the law alone: drafts look cheap
    for tokens in range(1, 41):
        speculator.record_step(tokens, 0.0303 if tokens <= 8 else 0.0362 + 0.0008 * (tokens - 9))
    assert speculator.plan(batch) == {}
    alone = Speculator(config, _fitted(0.020, 0.0002), max_model_len=4096, proposer=OnlyFirst())
    for tokens, seconds in ((1, 0.0203), (2, 0.0227), (3, 0.0253), (4, 0.0266), (5, 0.0280)):
        alone.record_step(tokens, seconds)
    # Three drafts pay there; a fourth adds 1/16 of an expected token for 1.4 ms.
    assert alone.plan(batch[:1]) == {batch[0]: (1, 2, 3)}
