"""One request's path through the pools, as seen from the ingress.

    tokens -> remote prefill? --yes--> PrefillServer.prefill -> first token
                 |                            | (fails twice, or pool saturated)
                 no                           v
                 +----------------> DecodeServer.generate -> tokens ...

The first token of a remote prefill is streamed at once. A prefill call that
fails or passes its deadline is retried once on another replica; after that
the decode replica prefills locally, so a dead prefill pool slows requests
down but never fails them.

Three parts: ``PoolClient.generate`` plans and runs the calls;
``pd.serve.stream.StreamTracker`` turns tokens into text and latency metrics;
``pd.serve.lease.Lease`` owns a remote prefill's pinned blocks and releases
them exactly once. Each call is a span of the request's ``Timeline`` (``pd.serve.timeline``),
with what the engines measured placed inside it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from ray.exceptions import RayActorError

from pd.config.app import AppArgs
from pd.engine.request import FinishReason, KVSource, finish_reason
from pd.sampling_params import SamplingParams
from pd.serve.lease import Lease
from pd.serve.metrics import RequestMetrics
from pd.serve.prefill_calls import PrefillQueues, awaited, release, release_before_retry
from pd.serve.probes import QuarantineProbes, probe_interval_s
from pd.serve.protocol import DecodeChunk, LoraRef, PoolRequest, PrefillResult, RequestFailed
from pd.serve.stream import GenerationEvent, StreamTracker
from pd.serve.text import TextStream
from pd.serve.timeline import Timeline, place_engine_timings
from router.hashing import ROOT_HASH, adapter_root_hash, hash_block_tokens
from router.protocol import RouteHints
from router.remote_prefill import predicted_remote
from router.shared import DECODE_SCOPE, PREFILL_SCOPE, RoutingScopes
from transfer.wire import decode_one_of

logger = logging.getLogger(__name__)

# After a request's prefill fails on two replicas, prefill locally for this long
# before trying the pool again, so a dead pool does not cost every request its deadline.
PREFILL_POOL_COOLDOWN_S = 5.0
PREDICTED_CALL_OVERHEAD_S = 0.004  # the remote path's extra Ray calls, as the predicted rule counts them
# How often a prefill call in flight checks that its replica is still alive.
LIVENESS_POLL_S = 0.1


class RequestFailedError(RuntimeError):
    """The request itself failed on an engine (its message says why; ``invalid``: the engine refused it as it
    stands, the client's error); no other request is affected."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.invalid = invalid


class DecodeReplicaLost(RuntimeError):
    """A stream's decode replica died or dropped it; the request can continue on another."""


class PoolClient:
    """The ingress's view of the two pools.

    ``routing_scopes`` is the ingress's: its request routers share with it
    where calls went and what the decode pool caches (``router.shared``).
    """

    def __init__(self, args: AppArgs, prefill_handle, decode_handle, tokenizer, eos_token_ids: tuple[int, ...],
                 max_model_len: int, routing_scopes: RoutingScopes):
        self.args = args
        self.prefill = prefill_handle
        self.decode = decode_handle
        self.metrics = RequestMetrics(args.served_model_name)
        self.rule = args.remote_prefill_rule()
        # What finishing a remote prefill's first token needs to know of the model.
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.prefill_routing = routing_scopes.open(PREFILL_SCOPE)
        self.decode_routing = routing_scopes.open(DECODE_SCOPE)
        self.prefill_in_flight = 0
        self.prefill_queues = PrefillQueues()
        self.prefill_pool_down_until = 0.0
        self.num_migrations = 0  # streams moved off a lost decode replica
        handles = {"prefill": prefill_handle, "decode": decode_handle}
        routings = {"prefill": self.prefill_routing, "decode": self.decode_routing}
        self.probes = QuarantineProbes({
            name: (routings[name], handles[name], interval) for name, pool, _, _ in args.pools()
            if handles[name] is not None and (interval := probe_interval_s(pool.router.gray_failure)) is not None})

    def wants_remote_prefill(self, hints: RouteHints, scores_prompt: bool = False) -> bool:
        """``router.remote_prefill``'s rule, while the prefill pool is not cooling down after failures.

        "Uncached" is what the decode replica would compute itself, estimated from the decode router's
        prefix index; all of a prompt it scores (whose every position's logits no cached block holds).
        """
        if self.args.mode != "disaggregated" or self.prefill is None or time.monotonic() < self.prefill_pool_down_until:
            return False
        if scores_prompt:
            hints = hints.replace(block_hashes=())
        if self.rule.predicted:  # by predicted seconds, once both pools' routers have data
            decode, prefill = self.decode_routing.predictions(), self.prefill_routing.predictions()
            remote = None if decode is None or prefill is None else predicted_remote(
                self.rule, decode, prefill, hints.block_hashes, hints.num_prompt_tokens,
                self.args.engine.block_size, PREDICTED_CALL_OVERHEAD_S, time.monotonic())
            if remote is not None:
                return remote
        elif not self.rule.may_go_remote(hints.num_prompt_tokens):
            return False
        uncached = self.decode_routing.estimate_uncached_tokens(hints.block_hashes, hints.num_prompt_tokens)
        return self.rule.wants_remote(hints.num_prompt_tokens, uncached, self.prefill_in_flight)

    async def remote_prefill(self, request: PoolRequest, hints: RouteHints,
                             timeline: Timeline | None = None) -> PrefillResult | None:
        """Prefill on the pool, retrying once elsewhere; None means prefill locally.

        Each attempt has its own request id (``<id>-p<n>``): an abandoned one
        never collides with the next, and its lease, if it got pinned after
        all, is released at once. A pool with no live replica left, or an
        attempt whose replica died, is given up at once, not at the deadline.
        """
        timeline = timeline if timeline is not None else Timeline(request.request_id)
        excluded: list[str] = []
        for attempt in range(2):
            if not self.prefill_routing.has_live_replica(excluding=excluded):
                logger.info("request %s: no live prefill replica; prefilling locally", request.request_id)
                timeline.add_before("prefill.given_up", 0.0, reason="no live prefill replica")
                return None
            attempt_id = f"{request.request_id}-p{attempt}"
            with timeline.span("prefill", request_id=attempt_id) as span:
                try:
                    result = await self._prefill_attempt(request.replace(request_id=attempt_id,
                                                                         traceparent=timeline.traceparent(span)),
                                                         hints.replace(request_id=attempt_id,
                                                                       exclude_replica_ids=tuple(excluded)))
                except (RequestFailedError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # noqa: BLE001 - the replica or the call failed: elsewhere, then locally
                    failed = self.prefill_routing.routed_replica(attempt_id)
                    span.set(replica=failed, error=repr(exc))
                    if failed is not None:
                        excluded.append(failed)
                        # in case it got pinned after all
                        await release_before_retry(self.prefill_routing, self.prefill, attempt_id, failed)
                    logger.warning("request %s: prefill attempt %d failed on %s: %r",
                                   request.request_id, attempt + 1, failed, exc)
                    if attempt == 0:
                        self.metrics.prefill_retries.inc()
                    continue
                span.set(replica=result.replica_id, num_cached_tokens=result.num_cached_tokens,
                         **_decision(self.prefill_routing, attempt_id))
            if result.handler_s > 0:  # placed back from the answer: before it in the call, Ray's own time
                timeline.add_before("prefill.handler", result.handler_s, end_s=span.end_s)
            place_engine_timings(timeline, "prefill", result.timings, end_s=span.end_s)
            return result
        timeline.add_before("prefill.given_up", 0.0, reason="two attempts failed; prefilling locally")
        self.prefill_pool_down_until = time.monotonic() + PREFILL_POOL_COOLDOWN_S
        return None

    async def _prefill_attempt(self, request: PoolRequest, hints: RouteHints) -> PrefillResult:
        """One call, watched: it ends at its deadline (which counts the prompts queued before it on its
        replica, ``pd.serve.prefill_calls``), or as soon as its replica is known dead."""
        start, own, placed = time.monotonic(), len(request.token_ids), None
        deadline = start + self.args.prefill_deadline_s(own)
        response = self.prefill.prefill.remote(hints.encode(), request.encode())
        call = asyncio.ensure_future(awaited(response))
        self.prefill_in_flight += 1
        try:
            while not (await asyncio.wait({call}, timeout=min(LIVENESS_POLL_S, deadline - time.monotonic())))[0]:
                routed = self.prefill_routing.routed_replica(request.request_id)
                if placed is None and routed is not None:
                    placed, report = routed, self.prefill_routing.reports.get(routed)
                    ahead = self.prefill_queues.place(routed, request.request_id, own,
                                                      report.num_waiting_tokens if report is not None else 0)
                    deadline = start + self.args.prefill_deadline_s(ahead + own)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no prefill answer in {deadline - start:g} s")
                if routed is not None and not self.prefill_routing.is_live(routed):
                    raise RuntimeError(f"prefill replica {routed} died")
                if not self.prefill_routing.has_live_replica(excluding=hints.exclude_replica_ids):
                    raise RuntimeError("no live prefill replica")
            answer = decode_one_of(call.result(), (PrefillResult, RequestFailed))
        except BaseException:
            call.cancel()
            response.cancel()  # the replica aborts the request and frees its blocks
            raise
        finally:
            self.prefill_in_flight -= 1
            if placed is not None:
                self.prefill_queues.done(placed, request.request_id)
        if isinstance(answer, RequestFailed):
            raise RequestFailedError(answer.error, answer.invalid)
        self.metrics.prefill.observe(time.monotonic() - start)
        return answer

    def release_lease(self, result: PrefillResult) -> None:
        release(self.prefill_routing, self.prefill, result.request_id, result.replica_id)

    def decode_replica_of(self, request_id: str) -> str | None:
        """The decode replica a request's stream was routed to (None before it is routed)."""
        return self.decode_routing.routed_replica(request_id)

    async def generate(
        self, request_id: str, token_ids: list[int], params: SamplingParams, stop: list[str],
        decode_replica: str | None = None, timeline: Timeline | None = None, lora: LoraRef | None = None,
        priority: int = 0,
    ) -> AsyncIterator[GenerationEvent]:
        """Run one request; the last event carries the finish reason.

        ``decode_replica`` pins the request to that decode replica, prefilled
        there (it holds the prompt's KV already: see ``pd.serve.choices``).
        Its calls are recorded in ``timeline`` (the HTTP request's). ``lora``:
        the adapter it runs under, whose root its block hashes chain from;
        ``priority`` its scheduling priority on both pools.
        """
        self.probes.start()
        if lora is not None:
            self.metrics.lora_requests.inc(tags={"adapter": lora.name})
        if decode_replica is not None and not self.decode_routing.is_live(decode_replica):
            decode_replica = None  # a pinned call to a replica that is gone would wait for it forever
        tracker = StreamTracker(self.metrics, TextStream(self.tokenizer, token_ids, stop), len(token_ids), timeline)
        hints = self.route_hints(request_id, token_ids, lora).replace(target_replica_id=decode_replica)
        request = PoolRequest(request_id=request_id, token_ids=tuple(token_ids), sampling=params, lora=lora,
                              priority=priority)
        with tracker.timeline.span("route", request_id=request_id, num_prompt_tokens=len(token_ids)) as route:
            remote = decode_replica is None and self.wants_remote_prefill(hints, params.prompt_logprobs is not None)
            route.set(prefill="remote" if remote else "local", pinned_decode_replica=decode_replica)
        prefilled = await self.remote_prefill(request, hints, tracker.timeline) if remote else None
        if prefilled is None:
            async for event in self._decode(request, hints, tracker, None):
                yield event
            return
        with Lease(self, prefilled) as lease:
            first = prefilled.first_token_id
            reason = finish_reason(params, first, 1, len(token_ids) + 1, self.max_model_len, self.eos_token_ids)
            logprobs = [prefilled.first_logprob] if prefilled.first_logprob is not None else []
            top = [prefilled.first_top_logprobs] if prefilled.first_top_logprobs is not None else []
            tracker.num_cached_tokens = prefilled.num_cached_tokens
            event = tracker.add([first], logprobs, reason, top_logprobs=top, prompt_logprobs=prefilled.prompt_logprobs)
            if event.finish_reason is not None:
                self.metrics.prefill_path.inc(tags={"path": KVSource.REMOTE.value})
                yield event
                return
            yield event  # a client leaving here ends the lease on the way out
            # The prompt was scored where it ran; the decode replica only continues.
            request = request.replace(kv_handle=prefilled.kv_handle, first_token_id=first,
                                      sampling=params.replace(prompt_logprobs=None))
            async for event in self._decode(request, hints, tracker, lease):
                yield event

    async def _decode(self, request: PoolRequest, hints: RouteHints, tracker: StreamTracker,
                      lease: Lease | None) -> AsyncIterator[GenerationEvent]:
        """Stream from a decode replica; if it dies mid-way, continue on another (``max_migrations``)."""
        prompt = request
        for migration in range(self.args.max_migrations + 1):
            try:
                may_move = migration < self.args.max_migrations  # off a quarantined replica, never failing
                async for event in self._decode_once(request, hints, tracker, lease, may_move):
                    yield event
                return
            except DecodeReplicaLost as lost:
                lost_replica = self.decode_routing.routed_replica(request.request_id)
                excluded = (*hints.exclude_replica_ids, *([lost_replica] if lost_replica else []))
                if migration == self.args.max_migrations or not self.decode_routing.has_live_replica(excluded):
                    raise lost.__cause__ or lost
                logger.warning("request %s: decode replica %s lost after %d tokens (%s); continuing elsewhere",
                               prompt.request_id, lost_replica, len(tracker.token_ids), lost)
                self.metrics.migrations.inc()
                self.num_migrations += 1
                request, hints = self._continuation(prompt, tracker.token_ids, migration + 1, excluded)

    def _continuation(self, prompt: PoolRequest, output: list[int], migration: int,
                      excluded: tuple[str, ...]) -> tuple[PoolRequest, RouteHints]:
        """The request that resumes ``prompt`` after ``output`` on another replica, which recomputes its KV.

        The last token streamed is passed as the first token: it is already
        out, so the new replica continues after it and never repeats one.
        """
        request_id = f"{prompt.request_id}-m{migration}"
        params = prompt.sampling
        if output:  # the prompt's scores, if asked for, went out with the first token
            request = PoolRequest(request_id=request_id, token_ids=prompt.token_ids + tuple(output[:-1]),
                                  sampling=params.replace(max_tokens=params.max_tokens - len(output) + 1,
                                                          prompt_logprobs=None),
                                  first_token_id=output[-1], num_generated=len(output) - 1, lora=prompt.lora,
                                  priority=prompt.priority)
        else:
            request = prompt.replace(request_id=request_id, kv_handle=None, first_token_id=None)
        hints = RouteHints(request_id=request_id, num_prompt_tokens=len(request.token_ids),
                           block_hashes=self._block_hashes(request.token_ids, prompt.lora),
                           exclude_replica_ids=excluded, adapter=prompt.lora.name if prompt.lora is not None else None)
        return request, hints

    def route_hints(self, request_id: str, token_ids, lora: LoraRef | None) -> RouteHints:
        """A prompt's routing hints: its length and block hashes, under its adapter."""
        return RouteHints(request_id=request_id, num_prompt_tokens=len(token_ids),
                          block_hashes=self._block_hashes(token_ids, lora),
                          adapter=lora.name if lora is not None else None)

    def _block_hashes(self, token_ids, lora: LoraRef | None) -> tuple[bytes, ...]:
        """The prompt's block hashes as the engines chain them: from its adapter's root, if it has one."""
        root = ROOT_HASH if lora is None else adapter_root_hash(lora.name, lora.digest)
        return tuple(hash_block_tokens(token_ids, self.args.engine.block_size, parent_hash=root))

    async def _decode_once(self, request: PoolRequest, hints: RouteHints, tracker: StreamTracker,
                           lease: Lease | None, may_move: bool = False) -> AsyncIterator[GenerationEvent]:
        span = tracker.timeline.begin("decode", request_id=request.request_id,
                                      kv="remote" if request.kv_handle is not None else "local")
        request = request.replace(traceparent=tracker.timeline.traceparent(span))
        stream = self.decode.options(stream=True).generate.remote(hints.encode(), request.encode())
        engine_finished = first_chunk = False
        try:
            async for data in stream:
                chunk = DecodeChunk.decode(data)
                if chunk.finish_reason is FinishReason.ABORT:  # its engine shut down under it
                    raise DecodeReplicaLost(f"request {request.request_id} was aborted by its decode replica")
                if chunk.finish_reason is FinishReason.ERROR:
                    engine_finished = True
                    raise RequestFailedError(chunk.error or "the request failed on its decode replica", chunk.invalid)
                if not first_chunk:
                    first_chunk = True
                    self._first_chunk(request, chunk, tracker, lease, span)
                    replica = self.decode_routing.routed_replica(request.request_id)
                    # A call pinned to a replica already held (``hints.target_replica_id``) went there on
                    # purpose: it stays. A routed stream moves even when its first token came after the
                    # quarantine (routed there just before it), or it would decode at the slow pace to its end.
                    pinned_while_held = (hints.target_replica_id is not None
                                         and self.decode_routing.is_quarantined(replica))
                place_engine_timings(tracker.timeline, "decode", chunk.timings)
                event = tracker.add(list(chunk.token_ids), list(chunk.logprobs), chunk.finish_reason,
                                    top_logprobs=chunk.top_logprobs, prompt_logprobs=chunk.prompt_logprobs)
                engine_finished = chunk.finish_reason is not None
                yield event
                if event.finish_reason is not None:
                    span.set(finish_reason=event.finish_reason, num_output_tokens=event.num_output_tokens)
                    if chunk.num_spec_draft_tokens:  # speculative decoding: what its drafts gave
                        span.set(spec_draft_tokens=chunk.num_spec_draft_tokens,
                                 spec_accepted_tokens=chunk.num_spec_accepted_tokens)
                    return
                if may_move and not pinned_while_held and self.decode_routing.is_quarantined(replica) \
                        and self.decode_routing.has_live_replica(excluding=(*hints.exclude_replica_ids, replica)):
                    span.set(moved="quarantined")
                    raise DecodeReplicaLost(f"decode replica {replica} was quarantined as persistently slow")
            raise DecodeReplicaLost(f"decode stream for {request.request_id} ended without a finish reason")
        except RayActorError as exc:  # the replica died or cannot be reached
            span.set(error=type(exc).__name__)
            raise DecodeReplicaLost(f"{type(exc).__name__}") from exc
        except (GeneratorExit, asyncio.CancelledError):
            span.set(cancelled=True)  # the client left, or the request's deadline passed
            raise
        except BaseException as exc:
            span.set(error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise
        finally:
            tracker.timeline.end(span)
            if not engine_finished:
                stream.cancel()  # the decode replica aborts the request and frees its blocks

    def _first_chunk(self, request: PoolRequest, chunk: DecodeChunk, tracker: StreamTracker, lease: Lease | None,
                     span) -> None:
        """What the first chunk from a decode replica settles: the path's metric, the lease, cached tokens."""
        self.metrics.prefill_path.inc(tags={"path": chunk.kv_source.value})
        if lease is not None:
            lease.settle(chunk.kv_source)
        if chunk.kv_source is not KVSource.REMOTE and not tracker.token_ids:
            tracker.num_cached_tokens = chunk.num_cached_tokens  # the prompt ran here
        span.set(replica=self.decode_routing.routed_replica(request.request_id), kv_source=chunk.kv_source.value,
                 num_cached_tokens=chunk.num_cached_tokens, **_decision(self.decode_routing, request.request_id))


def _decision(routing, request_id: str) -> dict[str, object]:
    """The routing policy's reason and the prompt tokens its chosen replica held, for a call's span."""
    decided = routing.routed_decision(request_id)
    return {} if decided is None else {"routing_reason": decided[0], "matched_tokens": decided[1]}
