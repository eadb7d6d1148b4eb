"""Which running decodes verify drafts this step, and how many: speculation priced by the step cost model.

Each step the scheduler asks ``Speculator.plan`` for drafts. A request is
eligible when it is a plain decode (one token behind, nothing in flight, no
prompt scores to compute, not a prefill's pinned request) with room for at
least one draft and a bonus token before ``max_tokens`` or the model's length.

**When not to speculate.** A draft token is worth computing when the tokens it
is expected to add per second exceed what the step already yields per
second. With the engine's own fit of its step time (``router.step_cost``:
``t = base + per_token * tokens + per_pair * pairs + per_seq * seqs +
per_sample * samples``, from ``LLMEngine.step_sums``), a plain decode step of
``B`` requests takes ``t0`` and yields ``B`` tokens; the ``j``-th draft of a
request whose drafts are accepted with probability ``alpha`` adds ``alpha**j``
expected tokens for ``c = per_token + per_sample + per_pair * context`` more
seconds. So request ``r`` drafts ``k_r`` tokens, the largest ``j`` with

    alpha_r ** j / c_r >= (1 + MARGIN) * B / t0

At batch 1 on a bandwidth-bound step (``c`` small against ``t0``) that is
most drafts any lookup finds; at saturation (``B / t0`` near ``1 / c``) it
is none, so a busy engine decodes as if it did not speculate. Until
``MIN_FIT_STEPS`` steps are recorded, requests draft the full
``num_speculative_tokens`` (the steps that fit the law need varied shapes).

**Acceptance per request.** ``alpha_r`` is estimated from the request's own
verify steps as a geometric rate (accepted drafts over accepted plus
rejected positions), with a prior of ``PRIOR_ALPHA`` worth ``PRIOR_WEIGHT``
positions, the counts decayed by ``DECAY`` at each verify. A request that
drafts nothing because its rate is too low has its counts decayed at each
step it is eligible, so its estimate drifts back to the prior and it probes
again later (about ``log(0.5) / log(DECAY)`` steps on). Lookups cost host
time, so a request with no draft budget is not looked up at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pd.engine.request import Request, RequestStatus
from pd.engine.spec.base import Proposer, make_proposer
from pd.engine.spec.config import SpeculativeConfig
from router.step_cost import StepSums, fit_linear, gram_matrix

PRIOR_ALPHA = 0.5
PRIOR_WEIGHT = 2.0
DECAY = 0.9
MARGIN = 0.05
MIN_FIT_STEPS = 32
# Steps between refits of the step cost law (a 5 x 5 solve).
REFIT_EVERY = 16


@dataclass
class SpecCounters:
    """Cumulative, per engine: verify groups, draft tokens verified, and those accepted."""

    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)


class Speculator:
    """Plans each step's drafts (``plan``) and learns from their verification (``observe``)."""

    def __init__(self, config: SpeculativeConfig, step_sums: StepSums, max_model_len: int,
                 proposer: Proposer | None = None):
        self.config = config
        self.step_sums = step_sums
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.counters = SpecCounters()
        # Drafts padded to one length a step, where verify steps replay CUDA graphs (``pd.engine.cuda_graphs``).
        self.uniform = False
        self._acceptance: dict[str, _Acceptance] = {}
        self._coefficients: np.ndarray | None = None
        self._fitted_at = -REFIT_EVERY

    def plan(self, running: Sequence[Request]) -> dict[Request, tuple[int, ...]]:
        """Drafts for the running requests that should verify some this step (most get none)."""
        eligible = [r for r in running if self._room(r) > 0]
        if not eligible:
            return {}
        threshold = self._threshold(running)
        wanted = []
        for request in eligible:
            acceptance = self._acceptance.setdefault(request.request_id, _Acceptance())
            k = min(self._room(request), self._budget(acceptance.alpha, request, threshold))
            if k <= 0:
                acceptance.accepted *= DECAY  # drift back to the prior: probe again later
                acceptance.rejected *= DECAY
                continue
            wanted.append((request, k))
        if not wanted:
            return {}
        propose_many = getattr(self.proposer, "propose_many", None)
        if propose_many is not None:  # a draft model drafts for the batch at once
            found = propose_many([(r.request_id, r.token_ids, k) for r, k in wanted])
            proposals = [(r, k, found.get(r.request_id)) for r, k in wanted]
        else:
            proposals = [(r, k, self.proposer.propose(r.request_id, r.token_ids, k)) for r, k in wanted]
        drafts = {request: tuple(proposal[:k]) for request, k, proposal in proposals if proposal}
        return self._uniform(eligible, drafts) if self.uniform and drafts else drafts

    def _uniform(self, eligible: list[Request], drafts: dict[Request, tuple[int, ...]]) -> dict[Request, tuple[int, ...]]:
        """Every eligible request's drafts padded to ``num_speculative_tokens`` (repeating its last token), so
        that the verify step has ``k + 1`` tokens a sequence and replays the CUDA graph captured for it. A
        padded draft is a guess like any other: accepted only where the target draws it."""
        k = self.config.num_speculative_tokens
        for request in eligible:
            if self._room(request) >= k:
                mine = drafts.get(request, ())
                drafts[request] = mine + ((mine or request.token_ids)[-1],) * (k - len(mine))
        return drafts

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``num_drafts`` drafts accepted the first ``num_accepted``."""
        counters = self.counters
        counters.spec_num_drafts += 1
        counters.spec_num_draft_tokens += num_drafts
        counters.spec_num_accepted_tokens += num_accepted
        request.num_spec_draft_tokens += num_drafts
        request.num_spec_accepted_tokens += num_accepted
        acceptance = self._acceptance.setdefault(request.request_id, _Acceptance())
        acceptance.accepted = acceptance.accepted * DECAY + num_accepted
        acceptance.rejected = acceptance.rejected * DECAY + (num_accepted < num_drafts)

    def finish(self, request: Request) -> None:
        """The request ended: forget its rate; the proposer may keep its output (``suffix``)."""
        self._acceptance.pop(request.request_id, None)
        self.proposer.finish(request.request_id, request.token_ids, request.num_prompt_tokens)

    def warm_up(self) -> None:
        """A draft model's first steps, paid at start (``ModelRunner.warm_up``)."""
        if hasattr(self.proposer, "warm_up"):
            self.proposer.warm_up()

    def close(self) -> None:
        if hasattr(self.proposer, "close"):
            self.proposer.close()

    def _room(self, request: Request) -> int:
        """Drafts ``request`` may verify now: 0 unless it is a plain decode with room for drafts and a bonus."""
        if (request.status is not RequestStatus.RUNNING or request.num_unread_tokens or request.num_inflight_tokens
                or request.pin_kv or request.num_computed_tokens != request.num_tokens - 1
                or request.num_prompt_logprobs_missing > 0):
            return 0
        left = min(request.sampling_params.max_tokens - len(request.output_token_ids),
                   self.max_model_len - request.num_tokens)
        return min(self.config.num_speculative_tokens, left - 1)

    def _budget(self, alpha: float, request: Request, threshold: float | None) -> int:
        """The most drafts worth verifying for ``request`` at acceptance rate ``alpha`` (module docstring)."""
        k = self.config.num_speculative_tokens
        if threshold is None or not self.config.backoff:
            return k
        c = self._coefficients
        cost = c[1] + c[4] + c[2] * request.num_computed_tokens + getattr(self.proposer, "seconds_per_token", 0.0)
        need = threshold * cost  # alpha ** j must reach it
        if need <= 0 or alpha >= 1:
            return k
        if need >= 1 or alpha <= 0:
            return 0
        return min(k, math.floor(math.log(need) / math.log(alpha)))

    def _threshold(self, running: Sequence[Request]) -> float | None:
        """``(1 + MARGIN) * B / t0``: the plain decode step's tokens per second, or None before a fit."""
        steps = self.step_sums.gram[0]
        if steps < MIN_FIT_STEPS:
            return None
        if steps - self._fitted_at >= REFIT_EVERY or self._coefficients is None:
            self._coefficients = fit_linear(gram_matrix(self.step_sums.gram), np.asarray(self.step_sums.moments))
            self._fitted_at = steps
        c = self._coefficients
        if c is None:
            return None
        batch = len(running)
        pairs = sum(r.num_computed_tokens + 1 for r in running)
        seconds = c[0] + (c[1] + c[3] + c[4]) * batch + c[2] * pairs
        return (1 + MARGIN) * batch / seconds if seconds > 0 else None


def make_speculator(config, step_sums: StepSums, num_blocks: int, max_model_len: int,
                    vocab_size: int) -> Speculator | None:
    """The engine's speculator for ``config.speculative_config`` (None without one); a draft model's proposer
    gets a pool of as many blocks as the target's (``pd.engine.spec.draft``)."""
    spec = config.speculative_config
    if spec is None:
        return None
    proposer = None
    if spec.method == "draft_model":
        from pd.engine.spec.draft import DraftModelProposer

        proposer = DraftModelProposer(config, spec.model, num_blocks, max_model_len, vocab_size)
    return Speculator(spec, step_sums, max_model_len, proposer)
