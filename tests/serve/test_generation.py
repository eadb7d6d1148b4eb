"""The ingress's per-request pieces that need no Serve: the lease owner and the shared finish rule."""

from __future__ import annotations

import pytest

from pd import SamplingParams
from pd.engine.request import FinishReason, KVSource, finish_reason
from pd.serve.generation import Lease
from pd.serve.protocol import PrefillResult

RESULT = PrefillResult(request_id="r", replica_id="p0", first_token_id=5, first_logprob=None, kv_handle=b"h",
                       num_cached_tokens=0)


class Releases:
    """What ``Lease`` calls on its pool client: ``release_lease``, recorded."""

    def __init__(self):
        self.released: list[str] = []

    def release_lease(self, result: PrefillResult) -> None:
        self.released.append(result.request_id)


@pytest.mark.parametrize("source, released", [
    (KVSource.REMOTE, []),  # pulled: the prefill replica frees the blocks on the pull's notification
    (KVSource.RECOMPUTE, ["r"]),
    (KVSource.LOCAL, ["r"]),
    (None, ["r"]),  # the stream ended before the decode replica answered
])
def test_a_lease_is_released_exactly_once_unless_it_was_pulled(source, released):
    client = Releases()
    with Lease(client, RESULT) as lease:
        if source is not None:
            lease.settle(source)
        lease.release()  # again, as an error path would: still at most once
    assert client.released == released


def test_a_lease_is_released_when_the_request_fails():
    client = Releases()
    with pytest.raises(RuntimeError):
        with Lease(client, RESULT):
            raise RuntimeError("the decode replica died")
    assert client.released == ["r"]


@pytest.mark.parametrize("token, num_output, num_tokens, expected", [
    (9, 1, 11, None),
    (2, 1, 11, FinishReason.STOP),  # EOS
    (7, 1, 11, FinishReason.STOP),  # a stop token, even on the last allowed token
    (9, 4, 14, FinishReason.LENGTH),  # max_tokens
    (9, 1, 32, FinishReason.LENGTH),  # the model's length, on the first token of a long prompt
])
def test_one_finish_rule(token, num_output, num_tokens, expected):
    params = SamplingParams(max_tokens=4, stop_token_ids=(7,))
    assert finish_reason(params, token, num_output, num_tokens, max_model_len=32, eos_token_ids=(2,)) is expected
    ignoring = params.replace(ignore_eos=True)
    if token == 2:
        assert finish_reason(ignoring, token, num_output, num_tokens, 32, (2,)) is None
