"""The decode pool: continues from a remote prefill's KV, or prefills locally."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator

from ray import serve

from pd.engine.request import FinishReason, KVSource
from pd.lora import AdapterId
from pd.serve.engine_server import EngineServer
from pd.serve.protocol import DecodeChunk, PoolControl, PoolRequest, RequestTimings
from router.protocol import RouteHints

logger = logging.getLogger(__name__)


@serve.deployment(name="DecodeServer")
class DecodeServer(EngineServer):
    role = "decode"

    def __init__(self, args: dict, prefill_handle=None):
        self._prefill = prefill_handle
        super().__init__(args, control=self._control if prefill_handle is not None else None)

    def _control(self, peer: str, payload: bytes) -> bytes:
        """Deliver torch-transport control bytes to the prefill replica ``peer`` (blocking)."""
        hints = RouteHints(request_id="", target_replica_id=peer).encode()
        call = self._prefill.handle_control.remote(hints, PoolControl(payload=payload).encode())
        try:
            return call.result(timeout_s=self.args.kv_read_timeout_s)
        except BaseException:
            call.cancel()  # a call pinned to a peer that is gone must not wait to be routed forever
            raise

    async def generate(self, hints: bytes, data: bytes) -> AsyncIterator[bytes]:
        """Stream encoded ``DecodeChunk``s for an encoded ``PoolRequest``.

        With a ``kv_handle`` the prompt KV is pulled from the prefill replica and
        generation continues after ``first_token_id``; a handle that cannot be
        used means the prompt is recomputed here. Cancelling the stream aborts
        the request and frees its blocks.
        """
        started_ns = time.time_ns()
        request = PoolRequest.decode(data)
        token_ids = list(request.token_ids)
        try:
            lora = await self._adapter(request)
        except ValueError as exc:  # the adapter cannot be had here: the request fails, and no retry helps
            yield self._failed(request, str(exc))
            return
        remote_kv = None
        if request.kv_handle is not None:
            adapter = None if request.lora is None else AdapterId(request.lora.name, request.lora.digest)
            remote_kv = self.engine.open_kv_handle(request.kv_handle, token_ids, adapter)
        await self.engine.compile_constraint(request.sampling)  # off the event loop
        arrived_ns = time.time_ns()
        try:
            stream = self.engine.add_request(request.request_id, token_ids, request.sampling,
                                             remote_kv=remote_kv, first_token_id=request.first_token_id,
                                             num_generated=request.num_generated, lora=lora, priority=request.priority)
        except ValueError as exc:  # refused as it stands (pd.engine.admission): no replica would take it
            yield self._failed(request, str(exc), invalid=True)  # a prefill lease ends with the ingress's release
            return
        last_token_at = timings = last = None
        num_tokens = 0
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    last, timings, num_tokens = out, timings or out.timings, num_tokens + len(out.new_token_ids)
                    if out.new_token_ids:
                        now = time.monotonic()
                        if last_token_at is not None:  # gaps after the first token here: the pull is not one
                            self.latency_window.observe((now - last_token_at) / len(out.new_token_ids))
                        last_token_at = now
                    yield self._chunk(request, out)
        finally:
            error = "" if last is not None and last.finish_reason not in (None, FinishReason.ERROR) else (
                (last.error if last is not None else "") or "cancelled or aborted")
            self._record_spans(request, started_ns, arrived_ns, timings, error, num_output_tokens=num_tokens,
                       finish_reason=last.finish_reason.value if last is not None and last.finish_reason else None,
                       kv_source=last.kv_source.value if last is not None else None)

    @staticmethod
    def _failed(request: PoolRequest, error: str, invalid: bool = False) -> bytes:
        """The one chunk of a request that failed before it reached the engine (``invalid``: refused by it)."""
        return DecodeChunk(request_id=request.request_id, token_ids=(), logprobs=(), finish_reason=FinishReason.ERROR,
                           num_cached_tokens=0, kv_source=KVSource.LOCAL, error=error, invalid=invalid).encode()

    def _chunk(self, request: PoolRequest, out) -> bytes:
        """One engine output as an encoded ``DecodeChunk``."""
        if out.finished:
            self.metrics.queue.observe(out.queue_seconds)
        return DecodeChunk(
            request_id=request.request_id,
            token_ids=tuple(out.new_token_ids),
            logprobs=tuple(out.new_logprobs),
            finish_reason=out.finish_reason,
            num_cached_tokens=out.num_cached_tokens,
            kv_source=out.kv_source,
            error=out.error or "",
            top_logprobs=tuple(out.new_top_logprobs),
            prompt_logprobs=tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
            timings=RequestTimings.of(out.timings),
            num_spec_draft_tokens=out.num_spec_draft_tokens,
            num_spec_accepted_tokens=out.num_spec_accepted_tokens,
        ).encode()
