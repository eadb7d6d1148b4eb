"""The synchronous engine: one step is schedule, run the model, update."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pd.config import EngineConfig, SchedulerConfig
from pd.engine.block_pool import BlockPool
from pd.engine.kv_cache_manager import KVCacheManager
from pd.engine.model_runner import ModelRunner, kv_block_bytes
from pd.engine.outputs import RequestOutput
from pd.engine.request import Request
from pd.engine.scheduler import Scheduler
from pd.model.builtin import resolve_model_path
from pd.model.config import load_model_config
from pd.model.loader import resolve_dtype
from pd.model.tokenizer import Tokenizer
from pd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_prefix_hit_tokens: int
    num_preemptions: int


class LLMEngine:
    """Owns a scheduler and a model runner. Not thread-safe: one caller drives ``step``."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_path(config.model)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        mc = self.model_config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}"
            )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        num_blocks = config.num_blocks
        if num_blocks is None:
            block_bytes = kv_block_bytes(mc, config.block_size, resolve_dtype(config.dtype, mc))
            num_blocks = max(1, config.kv_cache_bytes // block_bytes)
        self.scheduler_config = SchedulerConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self.block_pool = BlockPool(num_blocks)
        self.kv_cache = KVCacheManager(self.block_pool, config.block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache)
        self.runner = ModelRunner(config, mc, self.model_dir, num_blocks, self.max_model_len)
        self.eos_token_ids = mc.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer and self.tokenizer.eos_token_id is not None else ()
        )
        self._requests: dict[str, Request] = {}
        logger.info("engine ready: %s, %d KV blocks of %d tokens", self.model_dir, num_blocks, config.block_size)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field if this request cannot be served."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: prompt_token_ids must hold at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; it must be shorter than max_model_len {self.max_model_len}"
            )
        if params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens {params.max_tokens} exceeds max_model_len {self.max_model_len}")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        total = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        blocks = -(-total // self.config.block_size)
        if blocks > self.block_pool.num_blocks:
            raise ValueError(
                f"request needs {blocks} KV blocks (prompt + max_tokens = {total} tokens) but the pool has "
                f"{self.block_pool.num_blocks}; raise num_blocks or lower max_tokens"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request wherever it is and free its blocks; None if unknown or already done."""
        request = self.scheduler.abort(request_id)
        self._forget(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        block_tables = [self.kv_cache.block_ids(s.request.request_id) for s in out.scheduled]
        forward = self.runner.execute(out, block_tables)
        results = self.scheduler.update(out, forward)
        for result in results:
            if result.finished:
                self._forget(result.request_id)
        return results

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.runner.sampler.forget(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_free_blocks=self.block_pool.num_free_blocks,
            num_used_blocks=self.block_pool.num_used_blocks,
            num_cached_blocks=self.block_pool.num_cached_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
        )
