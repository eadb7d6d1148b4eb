"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A request with a ``seed`` owns a ``torch.Generator``, reseeded for every draw
from the seed and the position being sampled: its draws depend on neither
what else shares the batch nor which replica draws them, so a stream that
moves to another replica mid-way continues exactly as it would have.

The sampled rows without a seed are drawn together, from one generator
shared by the engine: on a GPU a few kernels for the whole step, where a row
at a time was about ten a row (at a batch of 256, thousands of launches a
step). Each row keeps its own temperature, top-k and top-p. On a CPU only a
small vocabulary's rows are drawn together (``CPU_TOGETHER_VOCAB``): a row
of a real model's vocabulary is drawn fastest alone, its passes in the
caches. Seeded rows are drawn one at a time, each from its own generator.

Each row fails alone: a row whose logits are not finite, or that has no
distribution left to draw from, or whose draw raises, gets no token and an
error for its request; the rest of the batch is sampled as if it were not
there.

Nothing here reads the device: ``draw`` leaves the tokens (and the
log-probabilities asked for) there, and the one read is ``DeviceSamples.read``
(``pd.engine.readback``). A row's finiteness is read with its token, so a
row that is not finite draws from zeros instead (its token is dropped).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pd.engine.host_copy import copy_floats_to_device, copy_to_device
from pd.engine.outputs import ForwardOutput
from pd.engine.readback import DeviceSamples, PromptScores
from pd.engine.request import Request
from pd.sampling_params import position_seed

if TYPE_CHECKING:
    from pd.engine.structured import GrammarMask

logger = logging.getLogger(__name__)

# On a CPU, rows are drawn together only up to this vocabulary, in chunks of ``CPU_CHUNK_LOGITS`` (256 KB of
# fp32, so that a chunk's passes stay in the caches). A row of a real model's vocabulary (32-150K tokens) is
# work enough on its own: drawn together, its extra passes cost more than a row's overheads (SmolLM2's 49K,
# batch 32: 80 against 56 ms), where at 512 tokens and batch 256 a row at a time took 32 ms against 7.
CPU_TOGETHER_VOCAB = 4096
CPU_CHUNK_LOGITS = 1 << 16


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
        drawable = None
        together = [row for row, request in enumerate(requests)
                    if not request.sampling_params.greedy and request.sampling_params.seed is None] \
            if self.device.type == "cuda" or logits.shape[-1] <= CPU_TOGETHER_VOCAB else []
        if together:
            drawable = self._draw_together(masked, usable, token_ids, requests, together)
        for row, request in enumerate(requests):
            if request.sampling_params.greedy or (together and request.sampling_params.seed is None):
                continue
            if drawable is None:
                drawable = torch.ones_like(usable)
            try:
                row_logits = torch.where(usable[row], masked[row], 0.0)
                drawable[row], token_ids[row] = self._sample_row(row_logits, request, offsets[row] if offsets else 0)
            except RuntimeError as exc:  # this request's draw alone: fail it, keep the batch
                logger.warning("request %s: sampling failed: %s", request.request_id, exc)
                draw_errors[row] = f"sampling failed: {exc}"
        samples = DeviceSamples(requests, token_ids, usable, draw_errors, *self._logprobs(logits, token_ids, requests),
                                prompt=prompt, drawable=drawable)
        return samples

    def _draw_together(self, masked: torch.Tensor, usable: torch.Tensor, token_ids: torch.Tensor,
                       requests: list[Request], rows: list[int]) -> torch.Tensor:
        """Draw ``rows`` (of ``requests``: unseeded, not greedy) from the shared generator into ``token_ids``, all
        at once on a GPU (a few kernels for the step, not a few a row), in chunks of ``CPU_CHUNK_LOGITS`` on a
        CPU (a chunk's passes stay in its caches): each row's temperature, top-k and top-p as
        ``_sample_row`` applies them to one row.

        Returns ``drawable``, bool for every row of the step: False where a drawn row had no distribution
        left (its logits overflowed at its temperature), which ``DeviceSamples.read`` fails alone.
        """
        device, vocab = masked.device, masked.shape[-1]
        params = [requests[row].sampling_params for row in rows]
        top_ks = [p.top_k if p.top_k is not None and p.top_k < vocab else 0 for p in params]
        top_ps = [p.top_p for p in params]
        (index, ks, k_index), _ = copy_to_device([rows, top_ks, [max(k, 1) - 1 for k in top_ks]], [], device)
        temperatures, top_p = copy_floats_to_device([[p.temperature for p in params], top_ps], device)
        drawable = torch.ones_like(usable)
        chunk = len(rows) if device.type == "cuda" else max(1, CPU_CHUNK_LOGITS // vocab)
        for a in range(0, len(rows), chunk):
            b = min(a + chunk, len(rows))
            ok, drawn = self._draw_rows(masked, usable, index[a:b], temperatures[a:b], max(top_ks[a:b]), ks[a:b],
                                        k_index[a:b], top_p[a:b] if min(top_ps[a:b]) < 1.0 else None)
            token_ids.index_copy_(0, index[a:b], drawn)
            drawable.index_copy_(0, index[a:b], ok)
        return drawable

    def _draw_rows(self, masked: torch.Tensor, usable: torch.Tensor, index: torch.Tensor, temperatures: torch.Tensor,
                   max_k: int, ks: torch.Tensor, k_index: torch.Tensor,
                   top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``_draw_together``'s rows ``index``: whether each has a distribution, and its draw."""
        chosen = masked.index_select(0, index)
        chosen.masked_fill_(~usable.index_select(0, index)[:, None], 0.0).div_(temperatures[:, None])
        if max_k:
            kth = torch.topk(chosen, max_k, dim=-1).values.gather(1, k_index[:, None])
            chosen.masked_fill_((chosen < kth) & (ks > 0)[:, None], float("-inf"))
        if top_p is not None:
            sorted_logits, order = torch.sort(chosen, descending=True, dim=-1)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Keep each row's smallest prefix whose mass reaches its top_p (a row at 1.0 keeps every token).
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]) & (top_p < 1.0)[:, None]
            chosen.masked_fill_(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
        probs = torch.softmax(chosen, dim=-1)
        # False for a NaN row: softmax's terms are in [0, 1] or NaN. Such a row draws from ones instead, and its
        # token is dropped: a CPU's multinomial raises for it, but a GPU's checks with a device-side assert,
        # which would end the CUDA context under every request on the replica.
        ok = probs.sum(dim=-1) > 0
        probs.masked_fill_(~ok[:, None], 1.0)
        return ok, torch.multinomial(probs, 1, generator=self._shared).squeeze(1)

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

    def _sample_row(self, logits: torch.Tensor, request: Request, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether the row has a distribution left (as ``_draw_rows`` tells), and its draw."""
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
        ok = probs.sum() > 0  # False for a NaN row, which multinomial must never see (see ``_draw_rows``)
        probs = torch.where(ok, probs, 1.0)
        return ok, torch.multinomial(probs, 1, generator=self._generator(request, offset))[0]

