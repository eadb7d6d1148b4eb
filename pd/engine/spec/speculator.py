"""Which running decodes verify drafts this step, and how many: speculation priced by the step's own cost.

Each step the scheduler asks ``Speculator.plan`` for drafts. A request is
eligible when it is a plain decode (one token behind, nothing in flight, no
prompt scores to compute, not a prefill's pinned request) with room for at
least one draft and a bonus token before ``max_tokens`` or the model's length.

**When not to speculate.** The step is planned as a whole. A plain decode
step of ``B`` requests yields ``B`` tokens in ``t(B)``; the ``j``-th draft of
a request whose drafts are accepted with probability ``alpha`` adds
``alpha**j`` expected tokens. The drafts taken are the ``D`` most likely
(largest ``alpha**j`` first) that maximise the step's expected tokens per
second, ``(B + sum of their alpha**j) / t(B + D)``, and only if that beats
the plain step's ``B / t(B)`` by ``MARGIN``. ``t(n)``, a step of ``n`` tokens,
is what the engine measured for steps of ``n`` tokens (a decayed mean), or,
for a size not yet run, its own fit of the linear step law
(``router.step_cost``, from ``LLMEngine.step_sums``), plus a draft model's
measured time per draft token. Measured sizes matter on a CPU, where a step
past ``pd.model.linear.FEW_ROWS`` rows leaves the few-row kernel and costs a
jump no linear law sees: one draft in a batch of 8 costs what four more do.
At batch 1 on a bandwidth-bound step that is most drafts any lookup finds;
at saturation (``B / t(B)`` near a token's own cost) none, so a busy engine
decodes as if it did not speculate. Until ``MIN_FIT_STEPS`` steps are
recorded, requests draft the full ``num_speculative_tokens``.

**Acceptance per request.** ``alpha`` is estimated from the request's own
verify steps as a geometric rate (accepted drafts over accepted plus
rejected positions), with a prior of ``PRIOR_ALPHA`` worth ``PRIOR_WEIGHT``
positions, the counts decayed by ``DECAY`` at each verify. A request that
drafts nothing has its counts decayed at each step it is eligible, so its
estimate drifts back to the prior and it probes again later (about
``log(0.5) / log(DECAY)`` steps on). Lookups cost host time, so a request
given no drafts is not looked up at all.
"""

from __future__ import annotations

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
# How far each new measure of a step size moves its mean.
MEASURED_WEIGHT = 0.2


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
        self._measured: dict[int, float] = {}  # step seconds by its tokens, decayed means

    def plan(self, running: Sequence[Request]) -> dict[Request, tuple[int, ...]]:
        """Drafts for the running requests that should verify some this step (most get none)."""
        rooms = {r: room for r in running if (room := self._room(r)) > 0}  # the eligible, and their room
        if not rooms:
            return {}
        budgets = self._budgets(running, rooms)
        wanted = []
        for request in rooms:
            k = budgets.get(request, 0)
            if k <= 0:
                acceptance = self._acceptance.setdefault(request.request_id, _Acceptance())
                acceptance.accepted *= DECAY  # drift back to the prior: probe again later
                acceptance.rejected *= DECAY
                continue
            wanted.append((request, k))
        if not wanted:
            return {}
        propose_many = getattr(self.proposer, "propose_many", None)
        if propose_many is not None:  # a draft model drafts for the batch at once, what the budgets allow
            found = propose_many([(r.request_id, r.token_ids, k) for r, k in wanted])
            drafts = {r: tuple(found[r.request_id][:k]) for r, k in wanted if found.get(r.request_id)}
        else:  # a lookup finds what it finds: the step is planned again over the drafts found
            found = {r: self.proposer.propose(r.request_id, r.token_ids, k) for r, k in wanted}
            budgets = self._budgets(running, {r: len(d) for r, d in found.items() if d})
            drafts = {r: tuple(d[:budgets[r]]) for r, d in found.items() if budgets.get(r)}
        return self._uniform(rooms, drafts) if self.uniform and drafts else drafts

    def _uniform(self, rooms: dict[Request, int], drafts: dict[Request, tuple[int, ...]]) -> dict[Request, tuple[int, ...]]:
        """Every eligible request's drafts padded to ``num_speculative_tokens`` (repeating its last token), so
        that the verify step has ``k + 1`` tokens a sequence and replays the CUDA graph captured for it. A
        padded draft is a guess like any other: accepted only where the target draws it."""
        k = self.config.num_speculative_tokens
        for request, room in rooms.items():
            if room >= k:
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

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds`` (the stepper's measure, or the simulator's model)."""
        known = self._measured.get(num_tokens)
        self._measured[num_tokens] = seconds if known is None else known + MEASURED_WEIGHT * (seconds - known)

    def _budgets(self, running: Sequence[Request], most: dict[Request, int]) -> dict[Request, int]:
        """How many of its ``most`` drafts each request verifies this step (module docstring); all of them
        before a fit or without the back-off."""
        if not self.config.backoff or not self._fit():
            return dict(most)
        gains = []  # (alpha ** j, request): each possible draft's expected tokens
        for request, k in most.items():
            alpha = self._acceptance.setdefault(request.request_id, _Acceptance()).alpha
            gain = 1.0
            for _ in range(k):
                gain *= alpha
                gains.append((gain, request))
        gains.sort(key=lambda item: -item[0])
        batch = len(running)
        context = sum(r.num_computed_tokens + 1 for r in running)
        per_draft = getattr(self.proposer, "seconds_per_token", 0.0)
        plain = batch / self.step_seconds(batch, batch, context)
        best, best_rate, expected = 0, plain * (1 + MARGIN), float(batch)
        for num_drafts, (gain, _) in enumerate(gains, start=1):
            expected += gain
            rate = expected / (self.step_seconds(batch + num_drafts, batch, context) + per_draft * num_drafts)
            if rate > best_rate:
                best, best_rate = num_drafts, rate
        budgets: dict[Request, int] = {}
        for _, request in gains[:best]:
            budgets[request] = budgets.get(request, 0) + 1
        return budgets

    def step_seconds(self, num_tokens: int, num_seqs: int, context: int) -> float:
        """A step of ``num_tokens`` tokens over ``num_seqs`` sequences attending ``context`` keys: as measured
        for that many tokens, else as the fitted law predicts (one logits row a token)."""
        measured = self._measured.get(num_tokens)
        if measured is not None:
            return measured
        c = self._coefficients
        return max(1e-9, c[0] + (c[1] + c[4]) * num_tokens + c[2] * (context + num_tokens) + c[3] * num_seqs)

    def _fit(self) -> bool:
        """Whether the step law is fitted (refitted every ``REFIT_EVERY`` steps once ``MIN_FIT_STEPS`` ran)."""
        steps = self.step_sums.gram[0]
        if steps < MIN_FIT_STEPS:
            return False
        if steps - self._fitted_at >= REFIT_EVERY or self._coefficients is None:
            self._coefficients = fit_linear(gram_matrix(self.step_sums.gram), np.asarray(self.step_sums.moments))
            self._fitted_at = steps
        return self._coefficients is not None


def make_speculator(config, step_sums: StepSums, num_blocks: int, max_model_len: int, vocab_size: int,
                    uniform: bool = False) -> Speculator | None:
    """The engine's speculator for ``config.speculative_config`` (None without one); a draft model's proposer
    gets a pool of as many blocks as the target's (``pd.engine.spec.draft``). ``uniform``: its verify steps
    replay CUDA graphs (``Speculator.uniform``)."""
    spec = config.speculative_config
    if spec is None:
        return None
    proposer = None
    if spec.method == "draft_model":
        from pd.engine.spec.draft import DraftModelProposer

        proposer = DraftModelProposer(config, spec.model, num_blocks, max_model_len, vocab_size)
    speculator = Speculator(spec, step_sums, max_model_len, proposer)
    speculator.uniform = uniform
    return speculator
