"""Log-probabilities as the engine reports them: the chosen token's, and the top alternatives.

Computed from the model's raw logits (log-softmax over the vocabulary),
before temperature, top-k/top-p or a grammar mask, as vLLM reports them by
default. ``TopLogprobs`` and ``PromptLogprob`` are msgspec structs because
they cross processes inside decode chunks and prefill results.

Prompt positions, for a prompt of ``n`` tokens::

    token:        t0    t1    t2   ...  t(n-1)
    logits at:    p0    p1    p2   ...  p(n-1)
    scores:             p0->t1 p1->t2    p(n-2)->t(n-1)

so ``n - 1`` entries; the first token has none.
"""

from __future__ import annotations

import msgspec
import torch


class TopLogprobs(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The ``k`` most likely tokens at one position, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One prompt token's log-probability given the tokens before it, and the top alternatives there."""

    logprob: float
    top: TopLogprobs


def score_targets(logits: torch.Tensor, target_ids: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device: each target token's log-probability under its row of ``logits [rows, vocab]``
    (fp32 ``[rows]``), and the top ``k`` of each row (ids int64 and log-probabilities ``[rows, k]``)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, target_ids[:, None]).squeeze(1)
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)
    return chosen, top_ids, top_values
