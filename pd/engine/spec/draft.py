"""``draft_model``: a smaller checkpoint with the target's vocabulary drafts greedily, run by the engine's own
``ModelRunner`` with a KV pool of its own.

The draft keeps one sequence per request (a ``Request`` of its own, greedy,
with its blocks in the draft's pool) that follows the target's tokens. At
each step the speculator asks for drafts, and for each request the draft:

1. **syncs** with the target: the tokens it computed that the target kept
   (its prefix of the target's tokens; after a verify step, the drafts the
   target accepted) stay, the rest are rolled back and their blocks freed;
2. **catches up** over the target's tokens it has not computed (the whole
   prompt the first time: a decode replica prefills the draft itself, in
   chunks of at most ``max_num_batched_tokens`` over all requests a step; a
   request still catching up drafts nothing that step), and samples the
   first draft from the last one's logits;
3. runs ``k - 1`` more one-token steps, each feeding the draft before.

Drafts are the draft model's argmax: verification accepts a draft when the
target draws that very token (``pd.engine.spec.verify``), so the output is
the target's own, exactly, and the argmax is the draft's best guess of it.
The draft's own time per drafted token is measured (``seconds_per_token``)
and priced into the speculator's decision beside the verify step's.

Under P/D the decode replica prefills the draft itself rather than pulling
a draft KV from the prefill replica: no wire or layout changes, and a draft
prefill costs what the draft's size says (measured in ``docs/performance.md``),
against a second KV pull on every request. The prefill replica's handle names
the target's layout only, which is all it moves.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from pd.config import EngineConfig
from pd.engine.block_pool import BlockPool
from pd.engine.kv_cache_manager import KVCacheManager
from pd.engine.kv_layout import pool_blocks
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import ScheduledRequest, SchedulerOutput
from pd.engine.request import Request, RequestStatus
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=1)


class DraftModelProposer:
    """``pd.engine.spec.base.Proposer`` over a draft model; ``propose_many`` drafts for a batch in ``k`` forwards."""

    def __init__(self, config: EngineConfig, draft_model: str, num_blocks: int, max_model_len: int,
                 vocab_size: int, make_runner=ModelRunner):
        model_dir = resolve_model_path(draft_model)
        model_config = load_model_config(model_dir)
        if model_config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.model {draft_model!r} has a vocabulary of {model_config.vocab_size} "
                             f"tokens; the target's has {vocab_size}: a draft must share the target's vocabulary")
        draft_config = dataclasses.replace(
            config, model=draft_model, revision=None, num_blocks=num_blocks, kv_cache_bytes=None,
            kv_cache_dtype="auto", kv_cache_scales=None, speculative_config=None, tensor_parallel_size=1,
            expert_parallel_size=1, num_redundant_experts=0, host_kv_cache_bytes=0, disk_kv_cache_path=None,
            disk_kv_cache_bytes=0, shared_kv_bucket=None, shared_kv_bytes=0, shared_kv_total_bytes=0)
        self.runner = make_runner(draft_config, model_config, model_dir, num_blocks, max_model_len)
        self.pool = BlockPool(pool_blocks(self.runner.kv_cache))
        self.kv_cache = KVCacheManager(self.pool, config.block_size, enable_prefix_caching=False)
        self.max_chunk_tokens = config.max_num_batched_tokens
        self._seqs: dict[str, Request] = {}
        self._synced: dict[str, int] = {}  # per request: how many of its draft's tokens are the target's own
        self._seconds = 0.0
        self._drafted = 0

    @property
    def seconds_per_token(self) -> float:
        """The draft's time per draft token proposed so far (0 before any)."""
        return self._seconds / self._drafted if self._drafted else 0.0

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        return self.propose_many([(request_id, token_ids, k)]).get(request_id, [])

    def propose_many(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """Up to ``k`` greedy drafts for each ``(request_id, token_ids, k)``; a request still catching up, or
        whose blocks the draft's pool cannot hold, gets none."""
        started = time.perf_counter()
        drafts: dict[str, list[int]] = {}
        budget = self.max_chunk_tokens
        out, ks = SchedulerOutput(), {}
        for request_id, token_ids, k in wanted:
            seq = self._sync(request_id, token_ids)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0 or not self.kv_cache.allocate_slots(seq, num_new + k - 1):
                continue
            budget -= num_new
            samples = seq.num_computed_tokens + num_new == seq.num_tokens
            out.scheduled.append(ScheduledRequest(seq, num_new, samples=samples))
            if samples:
                drafts[request_id], ks[request_id] = [], k
        while out.scheduled:
            forward = self.runner.execute(out, [self.kv_cache.block_ids(s.request.request_id) for s in out.scheduled])
            row, following = 0, SchedulerOutput()
            for item in out.scheduled:
                seq = item.request
                seq.num_computed_tokens += item.num_new_tokens
                if not item.samples:
                    continue
                token = forward.sampled_token_ids[row]
                row += 1
                if token is None:  # its logits were not finite: no more drafts for it this step
                    continue
                seq.token_ids.append(token)
                mine = drafts[seq.request_id]
                mine.append(token)
                if len(mine) < ks[seq.request_id]:
                    following.scheduled.append(ScheduledRequest(seq, 1, samples=True))
            out = following
        self._seconds += time.perf_counter() - started
        self._drafted += sum(len(d) for d in drafts.values())
        return {request_id: d for request_id, d in drafts.items() if d}

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> Request:
        """The request's draft sequence, its computed tokens cut to the target's, its tokens the target's."""
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = Request(request_id, list(token_ids), GREEDY)
            seq.status = RequestStatus.RUNNING
            self._synced[request_id] = len(token_ids)
            return seq
        kept = self._synced[request_id]  # its tokens up to here were the target's; compare the drafts after
        tokens = seq.token_ids
        limit = min(len(tokens), len(token_ids))
        while kept < limit and tokens[kept] == token_ids[kept]:
            kept += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, kept)
        seq.token_ids = list(token_ids)
        self._synced[request_id] = len(token_ids)
        self.kv_cache.trim(seq, seq.num_computed_tokens)
        return seq

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        seq = self._seqs.pop(request_id, None)
        self._synced.pop(request_id, None)
        if seq is not None:
            self.kv_cache.free(seq)
            self.runner.forget(request_id)

    def warm_up(self) -> None:
        self.runner.warm_up()

    def close(self) -> None:
        self.runner.close()
