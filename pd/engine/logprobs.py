"""Log-probabilities as the engine reports them: the chosen token's, and the top alternatives.

Computed from the model's raw logits (log-softmax over the vocabulary),
before temperature, top-k/top-p or a grammar mask, as vLLM reports them by
default. ``TopLogprobs`` and ``PromptLogprob`` are msgspec structs because
they cross processes inside decode chunks and prefill results.

Prompt positions, for a prompt of ``n`` tokens::

    token:        t0    t1    t2   ...  t(n-1)
    logits at:    p0    p1    p2   ...  p(n-1)
    scores:             p0->t1 p1->t2    p(n-2)->t(n-1)

so ``n - 1`` entries; the first token has none. They are scored on the device by
``pd.engine.readback``; this module imports no torch, since the ingress carries these types.
"""

from __future__ import annotations

import msgspec


class TopLogprobs(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The ``k`` most likely tokens at one position, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One prompt token's log-probability given the tokens before it, and the top alternatives there."""

    logprob: float
    top: TopLogprobs

