"""Verifying one-hot drafts by the target's own draws: exact, and the same tokens as without speculation.

A request with drafts ``d_1 .. d_k`` after its last token computes ``k + 1``
logits rows in one step. Row ``j`` is sampled exactly as a plain decode step
would sample that position (same temperature, top-k/top-p, grammar mask, and
for a seeded request the same per-position generator,
``pd.sampling_params.position_seed``), giving ``s_j``. The output is
``s_0 .. s_a``, where ``a`` is the longest prefix with ``s_j == d_{j+1}``:
every accepted draft is a token the target drew itself, and the first
mismatch (or the bonus row after the last draft) is the target's own token.

For a draft with no distribution of its own (one-hot: n-gram and suffix
lookup) this *is* rejection sampling (Leviathan et al.): ``d`` is accepted
with probability ``p(d)``, and on rejection the token is ``s ~ p`` given
``s != d``, which is the residual ``max(0, p - q)`` renormalised. So sampled
requests keep the target distribution, and greedy and seeded requests return
exactly the tokens the non-speculative engine returns, whatever was drafted.
A draft model's proposals are its argmax: the same rule keeps every output
token the target's own draw, accepted at ``sum p·q`` rather than
``sum min(p, q)`` for sampled requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pd.engine.request import FinishReason, finish_reason

if TYPE_CHECKING:
    from pd.engine.outputs import ForwardOutput
    from pd.engine.request import Request


def verified_rows(sampled: Sequence[int | None], drafts: Sequence[int], first_row: int,
                  stops: Callable[[int, int], bool] = lambda row, token: False) -> list[int]:
    """The rows of one verify group whose tokens are output, in order (at least the first, unless it failed).

    ``sampled``: every row's token, None for a failed row; the group is rows
    ``first_row .. first_row + len(drafts)``. ``stops(row, token)``: the token
    ends the request there (a grammar that terminated or rejected it), so
    nothing after it counts. A failed row ends the group before it.
    """
    rows = []
    for j in range(len(drafts) + 1):
        row = first_row + j
        token = sampled[row]
        if token is None:
            break
        rows.append(row)
        if stops(row, token) or j == len(drafts) or token != drafts[j]:
            break
    return rows


def append_verified(request: Request, forward: ForwardOutput, rows: Sequence[int], max_model_len: int,
                    ) -> tuple[list[int], list[float], list, FinishReason | None]:
    """Append the tokens of ``rows`` (``verified_rows``) to ``request``, each advancing its computed KV by one
    (the token before it is this step's), until one ends it: the tokens, their logprobs, their alternatives,
    and why it ended (None: it goes on)."""
    sampled = forward.sampled_token_ids
    tokens, logprobs, tops = [], [], []
    reason = None
    for row in rows:
        token_id = sampled[row]
        logprob = forward.logprobs[row] if forward.logprobs is not None else None
        request.append_output(token_id, logprob)
        request.num_computed_tokens += 1
        tokens.append(token_id)
        if logprob is not None:
            logprobs.append(logprob)
        if forward.top_logprobs is not None and forward.top_logprobs[row] is not None:
            tops.append(forward.top_logprobs[row])
        reason = FinishReason.STOP if row in forward.stop_rows else finish_reason(
            request.sampling_params, token_id, len(request.output_token_ids), len(request.token_ids),
            max_model_len, request.eos_token_ids)
        if reason is not None:
            break
    return tokens, logprobs, tops, reason
