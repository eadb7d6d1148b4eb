"""The prefill pool: computes prompts, pins their KV under a lease, returns a handle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ray import serve

from pd.engine.request import FinishReason
from pd.serve.engine_server import EngineServer
from pd.serve.protocol import PoolControl, PoolRequest, PrefillResult, RequestFailed, RequestTimings

logger = logging.getLogger(__name__)


@serve.deployment(name="PrefillServer")
class PrefillServer(EngineServer):
    role = "prefill"

    async def prefill(self, hints: bytes, data: bytes) -> bytes:
        """Prefill one prompt: an encoded ``PoolRequest`` in, an encoded ``PrefillResult`` out.

        ``RequestFailed`` instead when the request alone failed. ``hints``
        (``RouteHints``) are for the request router. Cancelling the call
        aborts the request and frees its blocks.
        """
        started, started_ns = time.monotonic(), time.time_ns()
        request = PoolRequest.decode(data)
        await self.engine.compile_constraint(request.sampling)  # off the event loop
        try:
            lora = await self._adapter(request)
        except ValueError as exc:  # the adapter cannot be had here: the request fails, and no retry helps
            return RequestFailed(request_id=request.request_id, error=str(exc)).encode()
        arrived_ns = time.time_ns()
        try:
            stream = self.engine.add_request(request.request_id, list(request.token_ids), request.sampling,
                                             pin_kv=True, lora=lora, priority=request.priority)
        except ValueError as exc:  # refused as it stands (pd.engine.admission): no replica would take it
            return RequestFailed(request_id=request.request_id, error=str(exc), invalid=True).encode()
        last = timings = None
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    last, timings = out, out.timings or timings
        finally:
            self._record_spans(request, started_ns, arrived_ns, timings, _prefill_error(last),
                       num_cached_tokens=last.num_cached_tokens if last is not None else None)
        if last is not None and last.finish_reason is FinishReason.ERROR:
            return RequestFailed(request_id=request.request_id, error=last.error or "request failed").encode()
        if last is None or last.finish_reason is FinishReason.ABORT or last.kv_handle is None:
            raise RuntimeError(f"prefill of {request.request_id} was aborted")
        self.metrics.queue.observe(last.queue_seconds)
        handler_s = time.monotonic() - started
        self.latency_window.observe(handler_s)
        self.num_prefilled += 1
        return PrefillResult(
            request_id=request.request_id,
            replica_id=self.replica_id,
            first_token_id=last.new_token_ids[0],
            first_logprob=last.new_logprobs[0] if last.new_logprobs else None,
            kv_handle=last.kv_handle,
            num_cached_tokens=last.num_cached_tokens,
            first_top_logprobs=last.new_top_logprobs[0] if last.new_top_logprobs else None,
            prompt_logprobs=tuple(last.prompt_logprobs) if last.prompt_logprobs is not None else None,
            timings=RequestTimings.of(timings),
            handler_s=handler_s,
        ).encode()

    async def release(self, hints: bytes, data: bytes) -> None:
        """End a lease early (an encoded ``PoolControl``): no decode will pull it."""
        self.engine.release_kv(PoolControl.decode(data).request_id)

    async def handle_control(self, hints: bytes, data: bytes) -> bytes:
        """The torch transport's control channel (an encoded ``PoolControl``)."""
        payload = PoolControl.decode(data).payload
        # The transport may block while it sends; keep the event loop free.
        return await asyncio.get_running_loop().run_in_executor(None, self.transport.handle_control, payload)

    async def __del__(self) -> None:
        """Serve calls this once the replica is out of every router and its calls are done.

        Decode replicas may still be reading KV it leased (a NIXL read does not
        pass through Serve), so it stays up until the last lease is released or
        expires: at most ``kv_lease_s``, inside ``graceful_shutdown_timeout_s``
        (``AppArgs`` checks the two agree).
        """
        engine = getattr(self, "engine", None)
        if engine is not None:
            leases = engine.stats().num_pinned_leases
            if leases:
                logger.info("prefill replica %s going away: serving %d KV leases until they end",
                            self.replica_id, leases)
            await engine.wait_for_leases()
        super().__del__()


def _prefill_error(last) -> str:
    """What went wrong with a prefill whose last output was ``last`` ("" when it pinned its KV)."""
    if last is None:
        return "ended before its first output"
    if last.finish_reason is FinishReason.ERROR:
        return last.error or "request failed"
    return "" if last.kv_handle is not None else "aborted"
