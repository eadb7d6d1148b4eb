"""The offline API: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from pd.config import EngineConfig
from pd.engine.engine import LLMEngine
from pd.engine.logprobs import PromptLogprob
from pd.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    # With SamplingParams(prompt_logprobs=k): one entry per prompt position after the first, the actual
    # token's log-probability and the top k there (pd.engine.logprobs), as the server's echo gives them.
    prompt_logprobs: list[PromptLogprob] | None = None


class LLM:
    """Generate from a batch of prompts with one engine in this process.

    ``model`` is ``"builtin:tiny-llama"`` or an HF checkpoint directory. Other
    keyword arguments are ``EngineConfig`` fields. With ``tensor_parallel_size``
    or ``expert_parallel_size`` above 1 the other ranks run as child processes
    until ``close`` (or the ``with`` block's end, or this process's exit).
    """

    def __init__(self, model: str = "builtin:tiny-llama", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        """The KV blocks the engine allocated (per rank with tensor parallelism: each holds its heads)."""
        return self.engine.block_pool.num_blocks

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV pool's bytes per token over all layers, measured from the pool this rank allocated: K and V
        of each of its KV heads, or multi-head latent attention's one latent row."""
        pool = self.engine.runner.kv_cache
        return pool.numel() * pool.element_size() // (pool.shape[0] * self.engine.config.block_size)

    def close(self) -> None:
        """Stop what runs beside the engine: its tensor-parallel workers, its KV tiers' writers."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.engine.model_dir} has no tokenizer (no tokenizer.json); pass prompts as token-id lists"
                )
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        # Validate everything before adding anything, so a bad prompt leaves the engine untouched.
        token_lists = [self._prompt_token_ids(p) for p in prompts]
        for token_ids, params in zip(token_lists, sampling_params):
            self.engine.validate(token_ids, params)
        outputs: dict[str, CompletionOutput] = {}
        order = []
        for token_ids, params in zip(token_lists, sampling_params):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, token_ids, params)
            outputs[request_id] = CompletionOutput(
                prompt_token_ids=token_ids, logprobs=[] if params.logprobs is not None else None
            )
            order.append(request_id)
        while self.engine.has_unfinished_requests():
            for result in self.engine.step():
                out = outputs[result.request_id]
                out.token_ids.extend(result.new_token_ids)
                if out.logprobs is not None:
                    out.logprobs.extend(result.new_logprobs)
                if result.prompt_logprobs is not None:
                    out.prompt_logprobs = list(result.prompt_logprobs)
                out.num_cached_tokens = result.num_cached_tokens
                if result.finished:
                    out.finish_reason = result.finish_reason.value
        if self.tokenizer is not None:
            for out in outputs.values():
                out.text = self.tokenizer.decode(out.token_ids)
        return [outputs[request_id] for request_id in order]
