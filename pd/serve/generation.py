"""One request's path through the pools, as seen from the ingress.

    tokens -> remote prefill? --yes--> PrefillServer.prefill -> first token
                 |                            | (fails twice, or pool saturated)
                 no                           v
                 +----------------> DecodeServer.generate -> tokens ...

The first token of a remote prefill is streamed at once. A prefill call that
fails or passes its deadline is retried once on another replica; after that
the decode replica prefills locally, so a dead prefill pool slows requests
down but never fails them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from pd.sampling_params import SamplingParams
from pd.serve.args import AppArgs
from pd.serve.messages import PREFILL_RECOMPUTE, DecodeChunk, PoolControl, PoolRequest, PrefillResult
from pd.serve.metrics import RequestMetrics
from pd.serve.text import TextStream
from router.hashing import hash_block_tokens
from router.serve import estimate_uncached_tokens, routed_replica

logger = logging.getLogger(__name__)

# After a request's prefill fails on two replicas, prefill locally for this long
# before trying the pool again, so a dead pool does not cost every request its deadline.
PREFILL_POOL_COOLDOWN_S = 5.0


@dataclass(frozen=True)
class GenerationEvent:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None  # "stop" or "length" on the last event
    num_prompt_tokens: int
    num_output_tokens: int


class PoolClient:
    """The ingress's view of the two pools."""

    def __init__(self, args: AppArgs, prefill_handle, decode_handle, tokenizer, eos_token_ids: tuple[int, ...]):
        self.args = args
        self.prefill = prefill_handle
        self.decode = decode_handle
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.metrics = RequestMetrics(args.served_model_name)
        self.prefill_in_flight = 0
        self.prefill_pool_down_until = 0.0

    def wants_remote_prefill(self, token_ids: list[int], block_hashes: list[bytes]) -> bool:
        """Remote when the uncached prompt is long and the prefill pool has room.

        "Uncached" is what the decode replica would compute itself, estimated
        from the decode router's prefix index: a prompt whose prefix the decode
        pool already holds prefills locally even when it is long.
        """
        if self.args.mode != "disaggregated" or self.prefill is None:
            return False
        if len(token_ids) <= self.args.remote_prefill_threshold:
            return False
        uncached = estimate_uncached_tokens("DecodeServer", block_hashes, len(token_ids))
        return (
            uncached > self.args.remote_prefill_threshold
            and self.prefill_in_flight < self.args.prefill_queue_bound
            and time.monotonic() >= self.prefill_pool_down_until
        )

    async def remote_prefill(self, request: PoolRequest) -> PrefillResult | None:
        """Prefill on the pool, retrying once elsewhere; None means prefill locally."""
        excluded: list[str] = []
        for attempt in range(2):
            call = dataclasses.replace(request, exclude_replica_ids=list(excluded))
            self.prefill_in_flight += 1
            response = self.prefill.prefill.remote(call.encode())
            start = time.monotonic()
            try:
                result = PrefillResult.decode(await asyncio.wait_for(response, self.args.prefill_timeout_s))
                self.metrics.prefill.observe(time.monotonic() - start)
                return result
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: try elsewhere, then locally
                response.cancel()
                failed = routed_replica(request.request_id)
                if failed is not None:
                    excluded.append(failed)
                logger.warning("request %s: prefill attempt %d failed on %s: %r",
                               request.request_id, attempt + 1, failed, exc)
                if attempt == 0:
                    self.metrics.prefill_retries.inc()
            finally:
                self.prefill_in_flight -= 1
        self.prefill_pool_down_until = time.monotonic() + PREFILL_POOL_COOLDOWN_S
        return None

    def release_lease(self, result: PrefillResult) -> None:
        message = PoolControl(request_id=result.request_id, target_replica_id=result.replica_id).encode()
        self.prefill.release.remote(message)

    async def generate(
        self, request_id: str, token_ids: list[int], params: SamplingParams, stop: list[str]
    ) -> AsyncIterator[GenerationEvent]:
        """Run one request; the last event carries the finish reason."""
        start = time.monotonic()
        text = TextStream(self.tokenizer, token_ids, stop)
        request = PoolRequest(
            request_id=request_id,
            token_ids=token_ids,
            sampling=params,
            block_hashes=hash_block_tokens(token_ids, self.args.engine.block_size),
        )
        prefilled: PrefillResult | None = None
        if self.wants_remote_prefill(token_ids, request.block_hashes):
            prefilled = await self.remote_prefill(request)
        num_output = 0
        last_token_at = start
        first_token_at = None
        if prefilled is not None:
            self.metrics.ttft.observe(time.monotonic() - start)
            num_output = 1
            last_token_at = first_token_at = time.monotonic()
            delta = text.add([prefilled.first_token_id])
            first = prefilled.first_token_id
            done = (
                params.max_tokens == 1
                or delta.stopped
                or first in (params.stop_token_ids or ())
                or (not params.ignore_eos and first in self.eos_token_ids)
            )
            if done:
                self.release_lease(prefilled)
                reason = "length" if params.max_tokens == 1 and not delta.stopped else "stop"
                tail = text.finish().text if not delta.stopped else ""
                self.metrics.prefill_path.inc(tags={"path": "remote"})
                self.metrics.e2e.observe(time.monotonic() - start)
                yield GenerationEvent([first], delta.text + tail, _logprobs(prefilled.first_logprob), reason,
                                      len(token_ids), 1)
                return
            try:
                yield GenerationEvent([first], delta.text, _logprobs(prefilled.first_logprob), None, len(token_ids), 1)
            except BaseException:  # the client left before decode started: free the pinned blocks now
                self.release_lease(prefilled)
                raise
            request = dataclasses.replace(request, kv_handle=prefilled.kv_handle,
                                          first_token_id=prefilled.first_token_id)
        stream = self.decode.options(stream=True).generate.remote(request.encode())
        finished = False
        path_counted = False
        try:
            async for data in stream:
                chunk = DecodeChunk.decode(data)
                if chunk.finish_reason == "abort":
                    raise RuntimeError(f"request {request_id} was aborted by its decode replica")
                now = time.monotonic()
                if not path_counted:
                    self.metrics.prefill_path.inc(tags={"path": chunk.prefill})
                    path_counted = True
                    if prefilled is not None and chunk.prefill == PREFILL_RECOMPUTE:
                        self.release_lease(prefilled)  # the decode replica will not pull it: free it now
                if num_output == 0:
                    self.metrics.ttft.observe(now - start)
                    first_token_at = now
                elif chunk.token_ids:
                    self.metrics.itl.observe(now - last_token_at)
                last_token_at = now
                num_output += len(chunk.token_ids)
                delta = text.add(chunk.token_ids)
                reason = "stop" if delta.stopped else chunk.finish_reason
                if reason is not None:
                    out_text = delta.text if delta.stopped else delta.text + text.finish().text
                    # A stop string can end the request before the engine does.
                    finished = chunk.finish_reason is not None
                    self.metrics.e2e.observe(time.monotonic() - start)
                    if first_token_at is not None:
                        self.metrics.decode.observe(time.monotonic() - first_token_at)
                    yield GenerationEvent(chunk.token_ids, out_text, chunk.logprobs, _openai_reason(reason),
                                          len(token_ids), num_output)
                    return
                yield GenerationEvent(chunk.token_ids, delta.text, chunk.logprobs, None, len(token_ids), num_output)
            raise RuntimeError(f"decode stream for {request_id} ended without a finish reason")
        finally:
            if not finished:
                stream.cancel()  # the decode replica aborts the request and frees its blocks
                if prefilled is not None:
                    self.release_lease(prefilled)


def _logprobs(value: float | None) -> list[float]:
    return [value] if value is not None else []


def _openai_reason(reason: str) -> str:
    return "stop" if reason == "stop" else "length"
