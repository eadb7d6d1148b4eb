"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A request with a ``seed`` owns a ``torch.Generator``, reseeded for every draw
from the seed and the position being sampled: its draws depend on neither
what else shares the batch nor which replica draws them, so a stream that
moves to another replica mid-way continues exactly as it would have.

Each row fails alone: a row whose logits are not finite, or whose draw
raises, gets no token and an error for its request; the rest of the batch
is sampled as if it were not there.

Nothing here reads the device: ``draw`` leaves the tokens (and the
log-probabilities asked for) there, and the one read is ``DeviceSamples.read``
(``pd.engine.readback``). A row's finiteness is read with its token, so a
row that is not finite draws from zeros instead (its token is dropped).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pd.engine.outputs import ForwardOutput
from pd.engine.readback import DeviceSamples, PromptScores
from pd.engine.request import Request
from pd.sampling_params import position_seed

if TYPE_CHECKING:
    from pd.engine.structured import GrammarMask

logger = logging.getLogger(__name__)

class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request: Request, offset: int = 0) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared
        generator = self._per_request.get(request.request_id)
        if generator is None:
            generator = self._per_request[request.request_id] = torch.Generator(device=self.device)
        # The position drawn: with a step in flight, after the token it samples (on the device still);
        # a verify row ``offset`` drafts further on (``pd.engine.spec.verify``).
        generator.manual_seed(position_seed(seed, request.num_tokens_with_unread + offset))
        return generator

    def sample(self, logits: torch.Tensor, requests: list[Request],
               grammar: GrammarMask | None = None) -> ForwardOutput:
        """``draw``, then read it at once."""
        return self.draw(logits, requests, grammar).read()

    def draw(self, logits: torch.Tensor, requests: list[Request], grammar: GrammarMask | None = None,
             prompt: PromptScores | None = None, offsets: list[int] | None = None) -> DeviceSamples:
        """Pick one token per row of fp32 ``logits [num_rows, vocab]``, within ``grammar``'s masks if any.

        ``requests[row]`` is the row's request; a request verifying drafts has a row per position, each
        ``offsets[row]`` tokens after its last. The tokens stay on the device with their log-probabilities
        (and ``prompt``'s scores, read with them).
        """
        # Grammar rows draw from masked logits; ``logits`` itself stays raw for the log-probabilities.
        masked = logits if grammar is None else grammar.apply(logits)
        # A row's max is NaN if any logit is, +inf if one is, -inf if all are: each unsamplable.
        usable = torch.isfinite(logits.amax(dim=-1))
        token_ids = masked.argmax(dim=-1)
        draw_errors = {}
        for row, request in enumerate(requests):
            if request.sampling_params.greedy:
                continue
            try:
                row_logits = torch.where(usable[row], masked[row], 0.0)
                token_ids[row] = self._sample_row(row_logits, request, offsets[row] if offsets else 0)
            except RuntimeError as exc:  # this request's draw alone: fail it, keep the batch
                logger.warning("request %s: sampling failed: %s", request.request_id, exc)
                draw_errors[row] = f"sampling failed: {exc}"
        samples = DeviceSamples(requests, token_ids, usable, draw_errors, *self._logprobs(logits, token_ids, requests),
                                prompt=prompt)
        return samples

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, requests: list[Request]):
        """The sampled tokens' raw log-probabilities, and the top alternatives, where any row asks for them."""
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(k is None for k in wanted):
            return None, None, None
        all_logprobs = torch.log_softmax(logits, dim=-1)
        logprobs = all_logprobs.gather(1, token_ids[:, None]).squeeze(1)
        max_k = max(k or 0 for k in wanted)
        if max_k == 0:
            return logprobs, None, None
        top_values, top_ids = torch.topk(all_logprobs, max_k, dim=-1)
        return logprobs, top_ids, top_values

    def _sample_row(self, logits: torch.Tensor, request: Request, offset: int = 0) -> torch.Tensor:
        params = request.sampling_params
        logits = logits / params.temperature
        if params.top_k is not None and params.top_k < logits.shape[-1]:
            threshold = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
            logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self._generator(request, offset))[0]
