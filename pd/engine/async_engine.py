"""The asyncio engine the serving layer drives.

One background task owns the engine. Requests and aborts queue up and are
applied between steps; each step runs on a worker thread, so the event loop
keeps serving while the model computes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import torch

from pd.config import EngineConfig
from pd.engine.admission import check_priority
from pd.engine.engine import LLMEngine
from pd.engine.memory import release_free_memory
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import RequestOutput
from pd.engine.request import FinishReason
from pd.engine.stats import EngineStats
from pd.engine.tp.driver import Launcher, TPWorkerError
from pd.lora import AdapterId
from pd.lora.manager import no_lora_error
from pd.sampling_params import SamplingParams
from router.events import CacheEvent
from router.protocol import RoutingStats
from transfer.base import KVTransport
from transfer.wire import KVHandle

logger = logging.getLogger(__name__)

# How often leases and pulls are polled while no request is running.
HOUSEKEEPING_INTERVAL_S = 0.005
# How often a busy engine gives freed heap memory back to the OS (pd.engine.memory);
# an engine going idle does it at once.
MEMORY_RELEASE_INTERVAL_S = 10.0


def _lowest_priority() -> None:
    """Run the calling thread at nice 19 (Linux schedules threads by their own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:  # not permitted here: the load runs at the engine's priority
        pass


class EngineDeadError(RuntimeError):
    """The engine's step failed; in-flight requests end with this error."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, transport: KVTransport | None = None, *,
                 launcher: Launcher | None = None):
        """``launcher`` starts the tensor-parallel workers (``pd.engine.tp.driver``; local processes if None)."""
        make_runner = functools.partial(ModelRunner, launcher=launcher)
        self.engine = LLMEngine(config, transport, make_runner=make_runner)
        self._fatal: BaseException | None = None  # what killed the engine for good (a tensor-parallel rank)
        # OpenMP gives a new thread the process's starting count (``OMP_NUM_THREADS``, which Ray sets to
        # the floor of a worker's CPUs), not the one the engine set, and oneDNN's GEMMs read it on the
        # thread that calls them: the step thread takes the engine's count before its first step.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-engine-step",
                                            initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        self._grammar_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-grammar")
        # LoRA adapters are read and checked here, at the lowest CPU priority: on a host whose cores the
        # steps use, a load must take what they leave, not stretch them.
        self._lora_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-lora-load",
                                                 initializer=_lowest_priority)
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[tuple[str, list[int], SamplingParams, dict]] = []
        self._pending_aborts: list[str] = []
        self._pending_releases: list[str] = []
        # Calls that change what the engine holds (LoRA adapters), run between steps: each with its future.
        self._pending_calls: list[tuple[Callable[[], object], asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._closed = False
        self._stepped_since_release = False
        self._last_release = time.monotonic()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def warm_up(self) -> None:
        """One warm-up step (``LLMEngine.warm_up``); call before the first request, from the constructing thread."""
        if self._loop_task is not None:
            raise RuntimeError("warm_up runs before the engine's loop starts")
        self.engine.warm_up()

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
        lora: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and return the stream of its incremental outputs.

        Bad input raises ``ValueError`` here, before anything is queued. Leaving
        the stream early (``aclose()``, or cancelling its consumer) aborts it.
        ``pin_kv``, ``remote_kv``, ``first_token_id``, ``num_generated``, ``lora`` (a loaded adapter's name:
        ``ensure_lora`` first) and ``priority`` are as in ``LLMEngine.add_request``.
        """
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._fatal is not None:
            raise EngineDeadError(f"engine is dead: {self._fatal}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.engine.validate(prompt_token_ids, params)
        self._ensure_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        # It arrives now, though the loop takes it in only after the step in flight: that wait is its queue's.
        options = {"pin_kv": pin_kv, "remote_kv": remote_kv, "first_token_id": first_token_id,
                   "num_generated": num_generated, "lora": lora, "priority": check_priority(priority),
                   "arrival_time": time.monotonic()}
        self._pending_adds.append((request_id, list(prompt_token_ids), params, options))
        self._wakeup.set()
        return self._stream(request_id, queue)

    async def load_lora(self, name: str, path: str) -> str:
        """Load (or reload) adapter ``name`` from ``path``: read and checked on a worker thread, registered
        between steps, so no step waits for the disk. Its digest; ``ValueError`` naming what is wrong."""
        manager = self._lora_manager(name)
        adapter = await asyncio.get_running_loop().run_in_executor(self._lora_executor, manager.read, name, path)
        return await self._between_steps(lambda: manager.add(name, path, adapter))

    async def unload_lora(self, name: str) -> int:
        """Refuse new requests for ``name`` from the next step on; how many running requests finish on it."""
        manager = self._lora_manager(name)
        return await self._between_steps(lambda: manager.unload(name))

    async def ensure_lora(self, name: str, path: str, digest: str) -> None:
        """Make adapter ``name`` the one whose weights have ``digest``, loading it from ``path`` if this engine
        holds other weights under that name or none; ``ValueError`` if the files there now have another."""
        if self._lora_manager(name).digest_of(name) == digest:
            return
        loaded = await self.load_lora(name, path)
        if loaded != digest:
            raise ValueError(f"LoRA adapter {name!r} at {path} changed since it was loaded (digest {loaded[:12]}, "
                             f"expected {digest[:12]}); load it again")

    def _lora_manager(self, name: str):
        if self.engine.lora is None:
            raise no_lora_error(name)
        return self.engine.lora

    async def _between_steps(self, call: Callable[[], object]):
        """``call()``'s result, run on the loop between two steps (never while one runs on the step thread)."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        future = asyncio.get_running_loop().create_future()
        self._pending_calls.append((call, future))
        self._ensure_loop()
        self._wakeup.set()
        return await future

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile ``params.structured`` on a worker thread, so that ``add_request`` finds it cached.

        Compiling a grammar is work whose cost the client picks (and the first
        one loads xgrammar, about a second): done in ``add_request`` it would
        run on the replica's event loop and stall every stream it serves.
        ``ValueError`` for a constraint that does not compile.
        """
        if params.structured is not None:
            def compile_constraint() -> None:
                self.engine.grammar_compiler.compile(params.structured)

            await asyncio.get_running_loop().run_in_executor(self._grammar_executor, compile_constraint)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._streams:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is; its stream finishes with reason ``abort``."""
        if request_id not in self._streams:
            return
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def release_kv(self, request_id: str) -> None:
        """Prefill role: end a request's lease early (no decode will pull it)."""
        self._pending_releases.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def check_health(self) -> None:
        """Raise if the engine loop died; a failed step alone does not kill it."""
        task = self._loop_task
        if self._fatal is not None:
            raise RuntimeError(f"engine is dead: {self._fatal}")
        try:
            self.engine.check_health()
        except TPWorkerError as exc:
            self._fatal = exc
            raise RuntimeError(f"engine is dead: {exc}") from exc
        if task is not None and task.done() and not self._closed:
            error = task.exception() if not task.cancelled() else "cancelled"
            raise RuntimeError(f"engine loop stopped: {error!r}")

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def rebalance_experts(self) -> None:
        """See ``ExpertsControl.rebalance`` (taken up by the loop's next step)."""
        self.engine.experts.rebalance()

    def expert_stats(self) -> dict:
        """See ``ExpertsControl.stats``."""
        return self.engine.experts.stats()

    def tp_ranks(self) -> list[dict[str, int]]:
        """See ``LLMEngine.tp_ranks``."""
        return self.engine.tp_ranks()

    async def wait_for_leases(self, poll_s: float = 0.05) -> None:
        """Return once no lease pins KV: each is released by the decode that pulled it, or expires."""
        while self.engine.stats().num_pinned_leases:
            await asyncio.sleep(poll_s)

    def cache_events(self) -> tuple[int, list[CacheEvent]]:
        """The prefix cache's numbered events (``LLMEngine.cache_events``); safe while a step runs."""
        return self.engine.cache_events()

    def routing_stats(self) -> RoutingStats:
        """See ``LLMEngine.routing_stats``; safe while a step runs, as ``cache_events`` is."""
        return self.engine.routing_stats()

    def open_kv_handle(self, data: bytes, prompt_token_ids: list[int], lora: AdapterId | None = None) -> KVHandle | None:
        """See ``LLMEngine.open_kv_handle``."""
        return self.engine.open_kv_handle(data, prompt_token_ids, lora)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="pd-engine-loop")

    def _apply_pending(self) -> None:
        calls, self._pending_calls = self._pending_calls, []
        for call, future in calls:
            try:
                result = call()
            except Exception as exc:  # noqa: BLE001 - the caller hears of it
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)
        adds, self._pending_adds = self._pending_adds, []
        for request_id, token_ids, params, options in adds:
            if request_id not in self._streams:
                continue
            try:
                self.engine.add_request(request_id, token_ids, params, **options)
            except ValueError as exc:  # e.g. a handle refused before any bytes move
                self._streams.pop(request_id).put_nowait(exc)
        releases, self._pending_releases = self._pending_releases, []
        for request_id in releases:
            self.engine.release_kv(request_id)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            queue = self._streams.pop(request_id, None)
            if queue is None:
                continue
            request = self.engine.abort_request(request_id)
            queue.put_nowait(
                RequestOutput(
                    request_id=request_id, new_token_ids=[], new_logprobs=[], finished=True,
                    finish_reason=FinishReason.ABORT,
                    num_cached_tokens=request.num_cached_tokens if request else 0,
                )
            )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                if self._pending_adds or self._pending_aborts or self._pending_releases or self._pending_calls:
                    continue
                if self._stepped_since_release:
                    await self._release_memory(loop)
                    continue
                if self.engine.has_pending_transfers():
                    # Leases must expire and notifications land even with nothing to run.
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), HOUSEKEEPING_INTERVAL_S)
                    except asyncio.TimeoutError:
                        pass
                    self.engine.poll_transfers()
                else:
                    await self._wakeup.wait()
                continue
            try:
                results = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # noqa: BLE001 - every in-flight stream must hear of it
                logger.exception("engine step failed; failing in-flight requests")
                self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))
                if isinstance(exc, TPWorkerError):  # a rank is gone: no later step can run
                    self._fatal = exc
                    raise
                continue
            self._stepped_since_release = True
            if time.monotonic() - self._last_release >= MEMORY_RELEASE_INTERVAL_S:
                await self._release_memory(loop)
            if not results and not self.engine.has_runnable_requests():
                # Only pulls in flight: poll them without spinning the CPU.
                await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            for result in results:
                queue = self._streams.get(result.request_id)
                if queue is None:
                    continue
                if result.finished:
                    del self._streams[result.request_id]
                queue.put_nowait(result)

    async def _release_memory(self, loop: asyncio.AbstractEventLoop) -> None:
        """Between steps, on the step thread: no model work allocates meanwhile."""
        await loop.run_in_executor(self._executor, release_free_memory)
        self._stepped_since_release = False
        self._last_release = time.monotonic()

    def _fail_all(self, error: Exception) -> None:
        for request_id, queue in list(self._streams.items()):
            self.engine.abort_request(request_id)
            queue.put_nowait(error)
        self._streams.clear()

    def close(self) -> None:
        """``LLMEngine.close``: the KV tiers' writers finish, the tensor-parallel workers stop."""
        self.engine.close()

    async def shutdown(self) -> None:
        """Fail in-flight requests, stop the loop and the worker thread."""
        self._closed = True
        self._fail_all(RuntimeError("engine is shut down"))
        if self._loop_task is not None:
            self._wakeup.set()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._executor.shutdown(wait=True)
        self._grammar_executor.shutdown(wait=False, cancel_futures=True)
        self._lora_executor.shutdown(wait=False, cancel_futures=True)
