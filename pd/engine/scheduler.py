"""Continuous batching in tokens, with chunked prefill and preemption by recompute.

Each step has a token budget (``max_num_batched_tokens``). Running requests go
first, in arrival order: a decode takes one token, a partial prefill takes what
the budget leaves. Waiting requests are admitted next, their prompts chunked to
what remains. When the pool runs out of blocks, the newest running request is
preempted: its blocks are freed and it recomputes later (its full blocks usually
come straight back from the prefix cache).

A request whose prompt KV lives on a prefill replica is admitted without
spending budget: it gets its blocks (reusing this engine's own prefix hits)
and waits in ``remote_waiting`` while the engine pulls the rest. When the pull
lands it joins ``running`` as a decode; when it fails it goes back to
``waiting`` and recomputes its prompt here.

Both queues are in priority order (``pd.engine.priority``: vLLM's ``priority``, lower first): the most
urgent are admitted and budgeted first, and preemption takes the least urgent.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING

from pd.config import SchedulerConfig
from pd.engine.block_pool import BlockPool
from pd.engine.kv_cache_manager import NO_MATCH, KVCacheManager
from pd.engine.logprobs import PromptLogprob
from pd.engine.outputs import EngineTimings, ForwardOutput, RequestOutput, ScheduledRequest, SchedulerOutput
from pd.engine.priority import enqueue, most_urgent_prompt, requeue
from pd.engine.request import FinishReason, KVSource, Request, RequestStatus, finish_reason
from pd.engine.spec.verify import append_verified, verified_rows
from pd.engine.step_budget import StepBudget
from pd.engine.tiers.base import NO_TIERS, Tiers
from pd.lora.admission import MAX_WAITS, AdapterRoom

if TYPE_CHECKING:
    from pd.engine.spec.speculator import Speculator


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: list[Request] = []
        self.num_prefix_hit_tokens = 0
        self.num_prompt_tokens = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (a recompute counts again)
        self.num_preemptions = 0
        # Speculative decoding (``pd.engine.spec.speculator``): proposes drafts for running decodes.
        self.speculator: Speculator | None = None
        self.step_budget = StepBudget()  # stall-free chunks beside decodes, once given a target (its module)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote_waiting)

    def add(self, request: Request) -> None:
        enqueue(self.waiting, request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.step_budget.begin(self.running)
        drafts = self.speculator.plan(self.running) if self.speculator is not None else {}
        index = 0
        kv_short = blocked = False
        urgent: int | None = None  # the most urgent priority with a prompt chunk in this step
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self.waiting and self.waiting[0].priority < request.priority and not (kv_short or blocked):
                # More urgent than the rest of the batch: admitted (and budgeted) ahead of it, so a batch
                # job's chunks never hold the budget from an urgent prompt. They sort in ahead of it. Short of
                # blocks, it takes the least urgent's not yet scheduled in this step, one at a time.
                num_running, num_waiting, num_scheduled = len(self.running), len(self.waiting), len(out.scheduled)
                budget = self._admit_waiting(budget, out, below=request.priority)
                urgent = most_urgent_prompt(out.scheduled[num_scheduled:], urgent)
                if len(self.waiting) == num_waiting and not self._preempt_for(self.waiting[0], index, out):
                    blocked = True  # it cannot fit in this step: the batch goes on without it
                index += max(0, len(self.running) - num_running)
                continue
            num_new = min(request.num_tokens_with_unread - request.num_scheduled_tokens, budget)
            if num_new > 1:  # a decode's one token always fits: only a chunk asks the step budget
                num_new = self.step_budget.cap(num_new, request.num_computed_tokens,
                                               request.num_prompt_logprobs_missing > 0, request.priority)
            if num_new <= 0 or (request.num_unread_tokens and self._ends_with_unread_token(request)) or (
                    num_new > 1 and urgent is not None and request.priority > urgent):
                # It ends when the step in flight is read; or it is a prompt less urgent than one in this step.
                index += 1
                continue
            draft = drafts.get(request, ())[:budget - num_new] if drafts else ()  # the budget counts k + 1
            if draft and not self.kv_cache.allocate_slots(request, num_new + len(draft)):
                draft = ()  # drafts take free blocks only: speculation never preempts
            num_preempted = len(out.preempted)
            if not draft and not self._allocate_or_preempt(request, num_new, out):
                break  # the request preempted itself; everything after it is gone too
            kv_short |= len(out.preempted) > num_preempted
            num_new += len(draft)
            out.scheduled.append(self._scheduled(request, num_new, draft))
            urgent = most_urgent_prompt(out.scheduled[-1:], urgent) if num_new > 1 and not draft else urgent
            budget -= num_new
            index += 1
        if not out.preempted:
            budget = self._admit_waiting(budget, out, below=None if urgent is None else urgent + 1)
        return out

    def _ends_with_unread_token(self, request: Request) -> bool:
        """The token the step in flight samples for ``request`` ends it by length, whatever its value."""
        unread = request.num_unread_tokens
        return bool(unread) and (len(request.output_token_ids) + unread >= request.sampling_params.max_tokens
                                 or request.num_tokens + unread >= self.config.max_model_len)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt_for(self, urgent: Request, index: int, out: SchedulerOutput) -> bool:
        """Preempt the least urgent running request, if it is less urgent than ``urgent`` and not yet scheduled
        in this step (at ``index`` or after); whether one was."""
        if len(self.running) <= index or self.running[-1].priority <= urgent.priority:
            return False
        victim = self.running.pop()
        self._preempt(victim)
        out.preempted.append(victim)
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput, below: int | None = None) -> int:
        """Admit waiting requests in order while the budget, the blocks and ``max_num_seqs`` allow (with
        ``below``, only those more urgent than that priority); one whose LoRA adapter finds no slot is passed
        over (``pd.lora.admission``)."""
        room = AdapterRoom(self.config.max_loras, [*self.running, *self.remote_waiting]) \
            if self.config.max_loras else None
        passed: list[Request] = []
        try:
            return self._admit_in_order(budget, out, room, passed, below)
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_in_order(self, budget: int, out: SchedulerOutput, room: AdapterRoom | None,
                        passed: list[Request], below: int | None) -> int:
        while self.waiting and len(self.running) + len(self.remote_waiting) < self.config.max_num_seqs:
            request = self.waiting[0]
            if below is not None and request.priority >= below:
                break
            if room is not None and not room.fits(request):
                request.num_lora_waits += 1
                if request.num_lora_waits > MAX_WAITS:
                    break  # it has waited long enough: the running adapters drain until it fits
                passed.append(self.waiting.popleft())
                continue
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                if not self._admit_remote(request, out):
                    break
                if room is not None:
                    room.admitted(request)
                continue
            if budget <= 0:
                break
            # A request scoring its prompt computes all of it: cached tokens would have no scores.
            scores_prompt = request.num_prompt_logprobs_missing > 0
            prefix = self.kv_cache.match_prefix(request) \
                if request.num_computed_tokens == 0 and not scores_prompt else NO_MATCH
            num_new = self.step_budget.cap(min(request.num_tokens - request.num_computed_tokens - prefix.num_tokens,
                                               budget), request.num_computed_tokens + prefix.num_tokens, scores_prompt,
                                           request.priority)
            if num_new <= 0 or not self.kv_cache.allocate_slots(request, num_new, prefix):
                break
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            if request.num_preemptions == 0:
                request.num_cached_tokens = prefix.num_tokens
                self.num_prefix_hit_tokens += prefix.num_tokens
                self.num_prompt_tokens += request.num_prompt_tokens
            request.num_computed_tokens += prefix.num_tokens
            request.status = RequestStatus.RUNNING
            enqueue(self.running, request)
            if room is not None:
                room.admitted(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            below = request.priority + 1 if num_new > 1 else below  # no less urgent prompt beside a prompt
        return budget

    def _admit_remote(self, request: Request, out: SchedulerOutput) -> bool:
        """Allocate every block the request needs; the missing prompt blocks will be pulled."""
        prefix = self.kv_cache.match_prefix(request)
        if not self.kv_cache.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix):
            return False
        self.waiting.popleft()
        request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = prefix.num_tokens
        request.num_cached_tokens = prefix.num_tokens
        self.num_prefix_hit_tokens += prefix.num_tokens
        self.num_prompt_tokens += request.num_prompt_tokens
        self.remote_waiting.append(request)
        out.remote_reads.append(request)
        return True

    def finish_remote_read(self, request: Request, succeeded: bool) -> None:
        """A pull ended: join the decode batch, or fall back to computing the prompt here."""
        self.remote_waiting.remove(request)
        if succeeded:
            request.num_computed_tokens = request.num_prompt_tokens
            request.status = RequestStatus.RUNNING
            self.kv_cache.cache_blocks(request)
            enqueue(self.running, request)
            return
        self.kv_cache.free(request)
        request.remote_kv = None
        request.kv_source = KVSource.RECOMPUTE
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        requeue(self.waiting, request)

    @staticmethod
    def _scheduled(request: Request, num_new: int, draft: tuple[int, ...] = ()) -> ScheduledRequest:
        samples = request.num_scheduled_tokens + num_new - len(draft) == request.num_tokens_with_unread
        return ScheduledRequest(request=request, num_new_tokens=num_new, samples=samples, draft_token_ids=draft)

    @staticmethod
    def launched(out: SchedulerOutput) -> None:
        """``out`` went to the device: its chunks are in flight, and its samples unread until ``update``."""
        for item in out.scheduled:
            request = item.request
            request.num_inflight_tokens += item.num_new_tokens
            request.num_unread_tokens += item.samples

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        requeue(self.waiting, request)

    def update(self, out: SchedulerOutput, forward: ForwardOutput) -> list[RequestOutput]:
        """Advance each scheduled request by its chunk and append sampled tokens (``launched`` ran on ``out``).

        A request that finished since ``out`` was scheduled (aborted, or ended by the step before it, read
        after this one launched) gets nothing from its row. One preempted since then (back to waiting,
        its blocks freed) still takes its token, as it would have before the preemption, and recomputes.
        """
        results = []
        sample_index = 0
        any_finished = False
        for item in out.scheduled:
            row = sample_index
            sample_index += item.num_samples
            if item.draft_token_ids:
                output = self._verify(item, forward, row)
                if output is None:
                    continue
            else:
                status = self._advance(item, forward.prompt_logprobs)
                if not item.samples or status is RequestStatus.FINISHED:
                    continue
                output = self._take_sample(item.request, forward, row)
            any_finished = any_finished or output.finished
            results.append(output)
        if any_finished:
            self._drop_finished()
        return results

    def _advance(self, item: ScheduledRequest, prompt_logprobs: dict[str, list[PromptLogprob]]) -> RequestStatus:
        """Land ``item``'s chunk: its request is no longer in flight, and a running one has computed it. Returns
        the request's status, read before anything here could change it."""
        request = item.request
        request.num_inflight_tokens -= item.num_new_tokens
        request.num_unread_tokens -= item.samples
        status = request.status
        if status is RequestStatus.RUNNING:
            uncomputed_prompt = len(request.prompt_token_ids) - request.num_computed_tokens
            if uncomputed_prompt > 0:
                self.num_computed_prompt_tokens += min(item.num_new_tokens, uncomputed_prompt)
                request.num_prompt_chunks += 1
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_blocks(request)
            if prompt_logprobs:
                request.prompt_logprobs += prompt_logprobs.get(request.request_id, ())
        return status

    def _verify(self, item: ScheduledRequest, forward: ForwardOutput, first_row: int) -> RequestOutput | None:
        """Land a verify chunk (``pd.engine.spec.verify``): output its verified rows' tokens, each advancing the
        computed KV by one, until one ends the request; free the blocks of the rejected drafts' slots."""
        request, drafts = item.request, item.draft_token_ids
        request.num_inflight_tokens -= item.num_new_tokens
        request.num_unread_tokens -= item.samples
        if request.status is not RequestStatus.RUNNING:
            return None
        sampled = forward.sampled_token_ids
        rows = verified_rows(sampled, drafts, first_row, lambda row, token: row in forward.stop_rows)
        if not rows:  # the last token's own row failed: the request fails as a decode would
            return self._take_sample(request, forward, first_row)
        accepted = sum(1 for j, row in enumerate(rows) if j < len(drafts) and sampled[row] == drafts[j])
        if self.speculator is not None:
            self.speculator.observe(request, len(drafts), accepted)
        tokens, logprobs, tops, reason = append_verified(request, forward, rows, self.config.max_model_len)
        if reason is not None:
            self._finish(request, reason)
        else:
            self.kv_cache.cache_blocks(request)
            self.kv_cache.trim(request, request.num_tokens)
        return self._output(request, tokens, logprobs, reason, top_logprobs=tops)

    def _take_sample(self, request: Request, forward: ForwardOutput, row: int) -> RequestOutput:
        """Append the token ``request`` sampled in ``row`` (or fail it with the row's error); finish it if it ends."""
        logprobs, top_logprobs, errors = forward.logprobs, forward.top_logprobs, forward.errors
        token_id = forward.sampled_token_ids[row]
        logprob = logprobs[row] if logprobs is not None else None
        top = top_logprobs[row] if top_logprobs is not None else None
        error = errors.get(row) if errors else None
        stops = row in forward.stop_rows
        if error is not None:
            self._finish(request, FinishReason.ERROR)
            return self._output(request, [], [], FinishReason.ERROR, error)
        request.append_output(token_id, logprob)
        reason = FinishReason.STOP if stops else finish_reason(
            request.sampling_params, token_id, len(request.output_token_ids), len(request.token_ids),
            self.config.max_model_len, request.eos_token_ids)
        if reason is not None:
            self._finish(request, reason)
        output = self._output(request, [token_id], [logprob] if logprob is not None else [], reason,
                              top_logprobs=[top] if top is not None else [])
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_reported:
            request.prompt_logprobs_reported = True  # the prompt is whole by its first sample
            output = dataclasses.replace(output, prompt_logprobs=list(request.prompt_logprobs))
        return output

    def _drop_finished(self) -> None:
        """Take the requests that finished out of the queues."""
        self.running = [r for r in self.running if not r.is_finished]
        if any(r.is_finished for r in self.waiting):  # preempted while its last step was in flight
            self.waiting = deque(r for r in self.waiting if not r.is_finished)

    def advance_decodes(self, sampled_rows: list[list[int]]) -> None:
        """Run ``len(sampled_rows)`` steps of a batch of decodes only, as ``schedule`` then ``update`` run them:
        each step allocates a slot for every running request (a new block at a block boundary), then advances
        each by its token, caching the blocks that fill. ``sampled_rows[step][index]``: what the running
        request at ``index`` samples in that step.

        For a caller that knows nothing else happens in those steps (the simulator's fast-forward,
        ``sim.fast_forward``): nothing waiting, every running request a decode that neither finishes nor
        stops in them and reports no logprobs, and a free block for every boundary crossed (no preemption).
        """
        allocate_slots, cache_blocks = self.kv_cache.allocate_slots, self.kv_cache.cache_blocks
        running = self.running
        for row in sampled_rows:
            for request in running:
                if not allocate_slots(request, 1):
                    raise RuntimeError(f"advance_decodes: no free block for request {request.request_id}; "
                                       "the caller must leave one for every boundary")
            for request, token_id in zip(running, row):
                request.num_computed_tokens += 1
                cache_blocks(request)
                request.append_output(token_id, None)

    @staticmethod
    def _output(request: Request, token_ids: list[int], logprobs: list[float], reason: FinishReason | None,
                error: str | None = None, top_logprobs: list | None = None) -> RequestOutput:
        ended = reason is not None
        return RequestOutput(
            request_id=request.request_id, new_token_ids=token_ids, new_logprobs=logprobs, finished=ended,
            finish_reason=reason, num_cached_tokens=request.num_cached_tokens, kv_source=request.kv_source,
            queue_seconds=request.queue_seconds, error=error, new_top_logprobs=top_logprobs or [],
            timings=EngineTimings.first_of(request) if token_ids else None,
            num_spec_draft_tokens=request.num_spec_draft_tokens if ended else 0,
            num_spec_accepted_tokens=request.num_spec_accepted_tokens if ended else 0)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if not (request.pin_kv and reason not in (FinishReason.ABORT, FinishReason.ERROR)):
            self.kv_cache.free(request)  # pinned blocks are freed when their lease ends

    def abort(self, request_id: str) -> Request | None:
        """Finish a request wherever it is and free its blocks; None if unknown or done."""
        for queue in (self.running, self.waiting, self.remote_waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, FinishReason.ABORT)
                    return request
        return None


def make_scheduler(config: SchedulerConfig, pool: BlockPool, tiers: Tiers = NO_TIERS) -> Scheduler:
    """A scheduler over ``pool`` (``config.num_blocks`` blocks, fresh, as an engine starts with) and ``tiers``."""
    return Scheduler(config, KVCacheManager(pool, config.block_size, tiers=tiers))

