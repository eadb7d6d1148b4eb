"""The ingress's per-request pieces that need no Serve: the lease owner and the shared finish rule."""

from __future__ import annotations

import pytest

from pd import SamplingParams
from pd.engine.request import FinishReason, KVSource, finish_reason
from pd.serve.lease import Lease
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


class _Response:
    """A fake ``DeploymentResponse``: awaitable, cancellable, answered when ``answer`` says."""

    def __init__(self, answer):
        self._answer = answer
        self.cancelled = False

    def __await__(self):
        return self._answer().__await__()

    def cancel(self):
        self.cancelled = True


class _PrefillPool:
    """A fake prefill handle: the first attempt fails; records when each call is made and when releases end."""

    def __init__(self, routing):
        self.routing = routing
        self.log: list[str] = []
        self.prefill = _Method(self, "prefill")
        self.release = _Method(self, "release")


class _Method:
    def __init__(self, pool: _PrefillPool, name: str):
        self.pool, self.name = pool, name

    def remote(self, hints: bytes, data: bytes) -> _Response:
        import asyncio

        from router.protocol import RouteHints

        request_id = RouteHints.decode(hints).request_id
        self.pool.log.append(f"{self.name} {request_id}")
        self.pool.routing.note_routed(request_id, f"replica-{request_id[-1]}")

        async def answer():
            await asyncio.sleep(0)  # answered on a later turn of the loop, as a real call is
            if self.name == "release":
                self.pool.log.append(f"released {request_id}")
                return None
            raise RuntimeError("this attempt's replica failed")

        return _Response(answer)


def test_a_retry_is_made_only_after_the_failed_attempts_release_went_out():
    """Serve places calls of one HTTP request by one id: a release and a retry must not be in placement at once."""
    import asyncio

    from pd.config.app import AppArgs
    from pd.serve.generation import PoolClient
    from pd.serve.protocol import PoolRequest
    from router.protocol import RouteHints
    from router.shared import PREFILL_SCOPE, RoutingScopes

    scopes = RoutingScopes()
    pool = _PrefillPool(scopes.open(PREFILL_SCOPE))
    client = PoolClient(AppArgs(), pool, None, None, (2,), 64, scopes)
    request = PoolRequest(request_id="r", token_ids=(1, 2, 3), sampling=SamplingParams())
    assert asyncio.run(client.remote_prefill(request, RouteHints(request_id="r"))) is None  # then prefilled locally
    assert pool.log == ["prefill r-p0", "release r-p0", "released r-p0", "prefill r-p1", "release r-p1",
                        "released r-p1"]


class _QueueingReplica:
    """A fake prefill handle whose one replica answers its calls in order, ``step_s`` apart (each prompt one step)."""

    def __init__(self, routing, step_s: float):
        self.routing, self.step_s = routing, step_s
        self.prefill = self
        self.answered: list[str] = []
        self._previous = None

    def remote(self, hints: bytes, data: bytes) -> _Response:
        import asyncio

        from pd.serve.protocol import RequestFailed
        from router.protocol import RouteHints

        request_id = RouteHints.decode(hints).request_id
        self.routing.note_routed(request_id, "only")
        previous, done = self._previous, asyncio.get_running_loop().create_future()
        self._previous = done

        async def answer():
            if previous is not None:
                await previous
            await asyncio.sleep(self.step_s)  # its compute, once the calls before it are done
            done.set_result(None)
            self.answered.append(request_id)
            return RequestFailed(request_id=request_id, error="answered").encode()

        return _Response(answer)


def test_a_prefill_calls_deadline_counts_the_prompts_queued_before_it_on_its_replica():
    """Three one-step prompts sent at once to one replica are a queue there: the third, answered after three
    steps, is not taken for a failed replica at one step's deadline (``pd.serve.prefill_calls``)."""
    import asyncio

    from pd.config.app import AppArgs
    from pd.serve.generation import PoolClient, RequestFailedError
    from pd.serve.protocol import PoolRequest
    from router.protocol import RouteHints
    from router.shared import PREFILL_SCOPE, RoutingScopes

    scopes = RoutingScopes()
    replica = _QueueingReplica(scopes.open(PREFILL_SCOPE), step_s=0.3)
    args = AppArgs(prefill_timeout_s=0.5, engine={"max_num_batched_tokens": 8})
    client = PoolClient(args, replica, None, None, (2,), 64, scopes)

    async def attempt(request_id: str) -> str:
        request = PoolRequest(request_id=request_id, token_ids=tuple(range(8)), sampling=SamplingParams())
        try:
            await client._prefill_attempt(request, RouteHints(request_id=request_id))
        except RequestFailedError:
            return "answered"
        except TimeoutError:
            return "timed out"
        return "?"

    async def burst() -> list[str]:
        return await asyncio.gather(*(attempt(f"r{k}") for k in range(3)))

    assert asyncio.run(burst()) == ["answered"] * 3
    assert replica.answered == ["r0", "r1", "r2"] and client.prefill_queues.tokens_on("only") == 0


def test_the_tokens_ahead_are_this_ingresss_calls_or_the_replicas_report_where_more():
    from pd.serve.prefill_calls import PrefillQueues

    queues = PrefillQueues()
    assert queues.place("a", "r0", 100) == 0 and queues.place("a", "r1", 50) == 100
    assert queues.place("a", "r2", 10, reported_waiting_tokens=900) == 900  # other ingresses' prompts there too
    assert queues.place("b", "r3", 10) == 0
    queues.done("a", "r0")
    queues.done("a", "gone")  # never placed: nothing to forget
    assert queues.tokens_on("a") == 60 and queues.place("a", "r4", 1) == 60
