"""Verifying one-hot drafts by the target's own draws: exact, and the same tokens as without speculation.

A request with drafts ``d_1 .. d_k`` after its last token computes ``k + 1``
logits rows in one step. Row ``j`` is sampled exactly as a plain decode step
would sample that position (same temperature, top-k/top-p, grammar mask, and
for a seeded request the same per-position generator,
``pd.engine.sampler.position_seed``), giving ``s_j``. The output is
``s_0 .. s_a``, where ``a`` is the longest prefix with ``s_j == d_{j+1}``:
every accepted draft is a token the target drew itself, and the first
mismatch (or the bonus row after the last draft) is the target's own token.

For a draft with no distribution of its own (one-hot: n-gram and suffix
lookup) this *is* rejection sampling (Leviathan et al.): ``d`` is accepted
with probability ``p(d)``, and on rejection the token is ``s ~ p`` given
``s != d``, which is the residual ``max(0, p - q)`` renormalised. So sampled
requests keep the target distribution, and greedy and seeded requests return
exactly the tokens the non-speculative engine returns, whatever was drafted.
(A draft model's proposals carry a distribution ``q`` and need the general
rule; none is served yet.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


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
