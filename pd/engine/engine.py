"""The synchronous engine: one step is schedule, run the model, update."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Callable

from pd.config import EngineConfig, SchedulerConfig
from pd.engine.admission import (
    check_num_generated,
    check_priority,
    check_request,
    first_token,
    max_model_len,
    start_grammar,
)
from pd.engine.block_pool import BlockPool, Evictions
from pd.engine.clock import SYSTEM_CLOCK, Clock
from pd.engine.derived import layout_fingerprint, num_pool_blocks, worker_transport
from pd.engine.disagg.connector import ConnectorTP, KVConnector
from pd.engine.kv_layout import kv_block_bytes, pool_blocks, pool_heads
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import RequestOutput
from pd.engine.overlap import StepPipeline
from pd.engine.reports import engine_stats, routing_stats
from pd.engine.request import FinishReason, KVSource, Request, RequestStatus, finish_reason
from pd.engine.scheduler import make_scheduler
from pd.engine.spec.speculator import make_speculator
from pd.engine.stats import EngineStats
from pd.engine.step_budget import StepBudget
from pd.engine.step_times import StepTimes
from pd.engine.stepper import Stepper
from pd.engine.structured import GrammarCompiler
from pd.engine.tiers.io import TierIO
from pd.engine.tiers.tiers import build_tiers
from pd.lora import AdapterId, LoRARequest
from pd.lora.adapter import LoraAdapter, load_adapter
from pd.lora.manager import LoraManager, make_lora_manager, no_lora_error
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from pd.sampling_params import SamplingParams
from router.events import CacheEvent
from router.protocol import RoutingStats
from router.step_cost import StepSums
from transfer.base import KVTransport
from transfer.wire import KVHandle, WireError

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns a scheduler and a model runner. Not thread-safe: one caller drives ``step``.

    With a ``transport`` the engine also serves disaggregated requests: see
    ``pd.engine.disagg.connector``. ``make_runner`` builds what runs the model
    (``ModelRunner``'s signature); the simulator passes one that models it,
    its own ``clock``, and ``tier_io``: what the disk tier's and the shared
    store's records are and what runs their I/O (``pd.engine.tiers.io.TierIO``).
    """

    def __init__(self, config: EngineConfig, transport: KVTransport | None = None, *,
                 make_runner: Callable[..., ModelRunner] = ModelRunner, clock: Clock = SYSTEM_CLOCK,
                 tier_io: TierIO | None = None, lora_loader: Callable[..., LoraAdapter] = load_adapter):
        self.config = config
        self.engine_id = uuid.uuid4().hex
        self.model_dir = resolve_model_path(config.model, config.revision)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        mc = self.model_config
        self.max_model_len = max_model_len(config.max_model_len, mc.max_position_embeddings)
        ranks = config.num_ranks
        runner_options = {}
        self.lora = make_lora_manager(config, mc, lora_loader)
        if self.lora is not None:
            runner_options["lora"] = self.lora.registry
        if ranks > 1 and transport is not None:  # each rank reads and serves its own heads
            runner_options["worker_transport"] = worker_transport(transport, self.engine_id)
        self.runner = make_runner(config, mc, self.model_dir, num_pool_blocks(config, mc, transport),
                                  self.max_model_len, **runner_options)
        num_blocks = pool_blocks(self.runner.kv_cache)  # the runner sizes a share of its device once loaded
        self.scheduler_config = SchedulerConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        # The tiers are built from the pool and the runner's KV cache, so after both; the pool takes the
        # forwarder of its evictions now, which the tiers bind to (``Evictions``).
        evictions = Evictions()
        self.block_pool = BlockPool(num_blocks, evictions=evictions)
        # Expert parallelism's statistics, rebalances on demand, and what runs between steps.
        self.experts = self.runner.experts_control
        self.fingerprint = layout_fingerprint(config, mc, self.runner.kv_dtype, self.runner.kv_scales)
        self.tiers = build_tiers(
            config, self.block_pool, evictions, self.runner.kv_cache,
            kv_block_bytes(mc, config.block_size, self.runner.kv_dtype), self.fingerprint.encode(), self.engine_id,
            clock=clock, io=tier_io)
        self.scheduler = make_scheduler(self.scheduler_config, self.block_pool, self.tiers)
        self.kv_cache = self.scheduler.kv_cache
        if transport is not None:
            transport.register(self.runner.kv_cache, num_heads=pool_heads(self.runner.kv_cache))
        self.step_times = StepTimes()
        self.step_sums = StepSums()  # the fit of this engine's own step cost (router.step_cost)
        self._bound_steps(num_blocks)
        # Speculative decoding: drafts for the running decodes, priced by that fit (pd.engine.spec).
        self.speculator = self.scheduler.speculator = make_speculator(
            config, self.step_sums, num_blocks, self.max_model_len, mc.vocab_size,
            uniform=getattr(self.runner, "graphs", None) is not None)
        self.connector = self._make_connector(transport, clock)
        self.stepper = Stepper(config, self.scheduler, self.runner, self.tiers, self.connector, self.step_times,
                               self.step_sums)
        self.eos_token_ids = mc.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer and self.tokenizer.eos_token_id is not None else ()
        )
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first structured request
        self._requests: dict[str, Request] = {}
        self._finished_at_admission: list[RequestOutput] = []
        logger.info("engine ready: %s, %d KV blocks of %d tokens", self.model_dir, num_blocks, config.block_size)

    def _make_connector(self, transport: KVTransport | None, clock: Clock) -> KVConnector:
        """What serves and pulls this engine's disaggregated KV (``pd.engine.disagg.connector``), over every
        tensor-parallel rank's heads."""
        config, mc = self.config, self.model_config
        tp, ranks = config.tensor_parallel_size, config.num_ranks
        runner = self.runner
        return KVConnector(
            self.engine_id, transport, self.fingerprint, self.kv_cache, self.scheduler,
            config.kv_lease_s, config.kv_read_timeout_s,
            block_bytes=kv_block_bytes(mc, config.block_size, runner.kv_dtype, tp), clock=clock,
            tp=(ConnectorTP(ranks, mc, runner.workers, lambda: runner.rank_transport_metadata()[:tp - 1],
                            attention_size=tp) if ranks > 1 else ConnectorTP(1, mc, None, list)),
        )

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles (and caches) structured-output constraints for this model; built on first use."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError(f"structured output needs a tokenizer, and model {self.model_dir} has no "
                                 "tokenizer.json")
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field if this request cannot be served.

        A ``structured`` constraint is compiled here (then cached, so admission reuses it).
        """
        check_request(prompt_token_ids, params, max_model_len=self.max_model_len,
                      vocab_size=self.model_config.vocab_size, block_size=self.config.block_size,
                      num_blocks=self.block_pool.num_blocks)
        if params.structured is not None:
            self.grammar_compiler.compile(params.structured)

    def resolve_lora(self, lora: LoRARequest | str) -> AdapterId:
        """The adapter a request naming ``lora`` would run under, loaded now if a ``LoRARequest`` names it
        first; ``ValueError`` (``UnknownAdapter`` for a name not loaded) as ``add_request`` would raise."""
        return self._lora_manager(lora).resolve(lora)

    def _lora_manager(self, lora: LoRARequest | str) -> LoraManager:
        """The engine's adapters; ``ValueError`` naming ``lora`` if it runs without any."""
        if self.lora is None:
            raise no_lora_error(lora if isinstance(lora, str) else lora.lora_name)
        return self.lora

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        pin_kv: bool = False,
        remote_kv: KVHandle | None = None,
        first_token_id: int | None = None,
        num_generated: int = 0,
        lora: LoRARequest | str | None = None,
        priority: int = 0, arrival_time: float | None = None,
    ) -> Request:
        """Queue a request.

        ``pin_kv`` (prefill role): stop after the first token and keep the prompt's
        blocks pinned; the finishing output carries the ``KVHandle``.
        ``remote_kv`` (decode role): the prompt was prefilled elsewhere; pull its KV
        and continue from the handle's first token, which counts as the first output.
        ``first_token_id`` without ``remote_kv``: the first output token was sampled
        elsewhere but its KV cannot be had, so the prompt is recomputed here.
        ``num_generated``: the last ``num_generated`` prompt tokens were generated
        under this request's ``structured`` constraint (a stream moved here mid-way).
        The request's grammar accepts those, then ``first_token_id``, before any
        token it samples; ``ValueError`` if one does not follow it. Compiling the
        grammar is client-controlled work, bounded as ``GrammarCompiler`` says.
        ``lora``: the adapter it runs under (``pd.lora``), a ``LoRARequest`` or a loaded adapter's name;
        ``UnknownAdapter`` (a ``ValueError``) for a name not loaded. ``priority``: vLLM's, lower is more
        urgent (``pd.engine.priority``). ``arrival_time`` (``time.monotonic``'s; default now): its queue counts from it.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora is not None:
            self._lora_manager(lora)
        self.validate(prompt_token_ids, params)
        check_num_generated(num_generated, len(prompt_token_ids))
        if pin_kv:
            self.connector.require_transport()
            params = params.replace(max_tokens=1)
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids, pin_kv=pin_kv,
                          priority=check_priority(priority), arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        first_token_id = first_token(remote_kv, first_token_id, self.model_config.vocab_size)
        generated = prompt_token_ids[len(prompt_token_ids) - num_generated:]
        grammar = None if params.structured is None else start_grammar(
            self.grammar_compiler, params.structured, generated, first_token_id)
        if first_token_id is not None and self._take_first_token(request, first_token_id, grammar):
            return request
        request.grammar = grammar
        if lora is not None:
            request.lora = self.lora.resolve(lora)
        if remote_kv is not None:
            if self.connector.accept(remote_kv, request.prompt_token_ids, request.lora):
                request.remote_kv = remote_kv
                request.kv_source = KVSource.REMOTE
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if request.lora is not None:  # nothing can refuse it now: it holds its adapter's weights until it ends
            self.lora.start(request)
        self._requests[request_id] = request
        self._queue(request)
        return request

    def _take_first_token(self, request: Request, token_id: int, grammar) -> bool:
        """A first token sampled elsewhere becomes ``request``'s first output; True if it already ends it (the
        request then finishes at admission: nothing to pull or compute)."""
        request.append_output(token_id, None)
        request.kv_source = KVSource.RECOMPUTE
        reason = FinishReason.STOP if grammar is not None and grammar.is_terminated else finish_reason(
            request.sampling_params, token_id, 1, request.num_tokens, self.max_model_len, self.eos_token_ids)
        if reason is None:
            return False
        self._finished_at_admission.append(RequestOutput(
            request_id=request.request_id, new_token_ids=[], new_logprobs=[], finished=True, finish_reason=reason,
            num_cached_tokens=0, kv_source=KVSource.RECOMPUTE))
        return True

    def _queue(self, request: Request) -> None:
        """To the scheduler; or held while its blocks load from the lower tiers, until ``poll_transfers``.

        A request scoring its prompt computes all of it: it loads nothing. The others are hashed now, which
        admission would do, so that reports count the prefix they will find (``pd.engine.reports.load_shape``).
        """
        if self.kv_cache.enable_prefix_caching and not request.num_prompt_logprobs_missing:
            self.kv_cache.update_hashes(request)
        if request.num_prompt_logprobs_missing or not self.tiers.begin(request):
            self.scheduler.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request wherever it is and free its blocks (and any lease); None if unknown."""
        self.connector.abort(request_id)
        request = self.scheduler.abort(request_id)
        if self.tiers.cancel(request_id) and request is None:
            request = self._requests.get(request_id)  # held for its tier loads: it never reached the scheduler
            request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
        self._forget(request_id)
        return request

    def release_kv(self, request_id: str) -> bool:
        """Prefill role: end a lease early (no decode will pull it); idempotent."""
        return self.connector.release(request_id)

    def open_kv_handle(self, data: bytes, prompt_token_ids: list[int],
                       lora: AdapterId | None = None) -> KVHandle | None:
        """Decode role: the ``KVHandle`` in ``data`` if this engine can pull ``prompt_token_ids``' KV with it.

        None when the handle is unusable (garbled, another layout, transport,
        prompt or LoRA adapter ``lora``): the prompt is then recomputed here,
        counted as a fallback.
        """
        try:
            handle = KVHandle.decode(data)
            self.connector.check(handle, prompt_token_ids, lora)
        except WireError as exc:
            logger.warning("unusable KV handle (%s); recomputing the prompt locally", exc)
            self.connector.note_fallback()
            return None
        return handle

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished or bool(self._finished_at_admission)
                or self.tiers.num_waiting > 0 or self.step_in_flight)

    def has_runnable_requests(self) -> bool:
        """Requests the scheduler can run now (not only waiting for their KV to arrive), or a step to read."""
        return self.stepper.has_runnable_requests()

    @property
    def pipeline(self) -> StepPipeline | None:
        """With async scheduling (``EngineConfig.async_scheduling``, ``pd.engine.overlap``): the step in flight,
        launched before the one before it is read. None: each step is read before the next is scheduled."""
        return self.stepper.pipeline

    @property
    def step_in_flight(self) -> bool:
        """A step launched and not yet read (async scheduling): the next ``step`` returns its outputs."""
        return self.stepper.in_flight

    def has_pending_transfers(self) -> bool:
        """Leases to expire, pulls or tier writes to poll: they need ``poll_transfers`` calls even when idle."""
        return self.connector.has_pending_work or self.tiers.has_pending_work

    def poll_transfers(self) -> None:
        """Leases, notifications and pulls, and the KV tiers' writes, between steps."""
        self.connector.poll()
        for request in self.tiers.poll():  # their tier loads are done
            self.scheduler.add(request)

    def cache_events(self, after_seq: int | None = None) -> tuple[int, list[CacheEvent]]:
        """``(first_seq, events)`` of the prefix cache (see ``BlockPool.cache_event_window``)."""
        return self.block_pool.cache_event_window(after_seq)

    def routing_stats(self, after_seq: int | None = None) -> RoutingStats:
        """What this engine's replica publishes to request routers (``pd.engine.reports``); ``after_seq``: only
        the cache events after it (for a reader known to have applied the rest)."""
        return routing_stats(self, after_seq)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, update (``pd.engine.stepper``). Requests that ended at admission come out
        first."""
        early, self._finished_at_admission = self._finished_at_admission, []
        self.poll_transfers()
        return early + self._finish(self.stepper.step(may_wait=not early))

    def _finish(self, results: list[RequestOutput]) -> list[RequestOutput]:
        """Forget the finished requests; a prefill's (``pin_kv``) output carries its pinned KV's handle."""
        for index, result in enumerate(results):
            if not result.finished:
                continue
            request = self._requests.get(result.request_id)
            if request is not None and request.pin_kv and result.finish_reason is not FinishReason.ERROR:
                results[index] = dataclasses.replace(result, kv_handle=self.connector.pin(request))
            self._forget(result.request_id)
        return results

    def _bound_steps(self, num_blocks: int) -> None:
        """Cut prompt chunks beside decodes to ``itl_target_s``, and steps of less urgent prompts to
        ``low_priority_step_s`` (``pd.engine.step_budget``); say at start if the pool holds less than
        ``max_model_len``."""
        config = self.config
        if config.itl_target_s is not None or config.low_priority_step_s is not None:
            self.scheduler.step_budget = StepBudget(config.itl_target_s, self.step_sums, config.block_size,
                                                    low_priority_s=config.low_priority_step_s)
        if num_blocks * config.block_size < self.max_model_len:
            logger.warning("the KV pool holds %d tokens, fewer than max_model_len %d: a longer request is refused "
                           "(raise kv_cache_bytes or lower max_model_len)", num_blocks * config.block_size,
                           self.max_model_len)

    def warm_up(self) -> None:
        """Run a prefill and a decode step outside any request (``ModelRunner.warm_up``), and log its time."""
        started = time.monotonic()
        self.runner.warm_up()
        if self.speculator is not None:
            self.speculator.warm_up()
        logger.info("engine warmed up in %.2f s", time.monotonic() - started)

    def check_health(self) -> None:
        """Raise if what runs beside the engine died (a tensor-parallel worker)."""
        self.runner.check_health()

    def tp_ranks(self) -> list[dict[str, int]]:
        """Each tensor-parallel rank's ``rank``, process ``pid`` and ``weight_bytes`` held, rank 0 first
        (one entry without tensor parallelism)."""
        return self.runner.ranks()

    def close(self) -> None:
        """Stop the KV tiers' writers once the writes queued are done (the disk keeps its blocks), and the
        tensor-parallel workers. The engine cannot step after this."""
        self.tiers.close()
        self.runner.close()
        if self.speculator is not None:
            self.speculator.close()

    def _forget(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            request.grammar = None  # its matcher's native memory goes now, not with the last reference
            if self.speculator is not None:
                self.speculator.finish(request)
            if self.lora is not None:
                self.lora.finish(request)
        self.runner.forget(request_id)
        self.tiers.release(request_id)  # a request that never had a prefix match holds nothing either

    def stats(self) -> EngineStats:
        """The engine's counters (``pd.engine.reports``)."""
        return engine_stats(self)
