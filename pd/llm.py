"""The offline API: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from pd.config import EngineConfig
from pd.engine.admission import check_priority
from pd.engine.engine import LLMEngine
from pd.engine.logprobs import PromptLogprob
from pd.lora import LoRARequest
from pd.lora.manager import LoraManager, no_lora_error
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

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter under its name, or reload it with the weights now at its path: new requests run on
        those, requests already running keep theirs, and no KV of the old weights is reused."""
        self._lora(lora_request.lora_name).load(lora_request.lora_name, lora_request.lora_path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``: new requests naming it are refused; those running finish on it."""
        self._lora(name).unload(name)

    def list_loras(self) -> dict[str, str]:
        """Each loaded adapter's name and the path it loads from."""
        return {} if self.engine.lora is None else self.engine.lora.adapters()

    def _lora(self, name: str) -> LoraManager:
        if self.engine.lora is None:
            raise no_lora_error(name)
        return self.engine.lora

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

    @staticmethod
    def _per_prompt(lora_request, num_prompts: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        loras = list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(f"got {len(loras)} lora_requests for {num_prompts} prompts")
        for lora in loras:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request must be a pd.LoRARequest or None, got {type(lora).__name__}")
        return loras

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``lora_request``: the LoRA adapter every prompt runs under, or a list of one per prompt (None: the base
        model); the engine needs ``enable_lora=True``. ``priority``: one per prompt (lower is more urgent), as
        vLLM's.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        loras = self._per_prompt(lora_request, len(prompts))
        priorities = [0] * len(prompts) if priority is None else [check_priority(p) for p in priority]
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        # Validate everything before adding anything, so a bad prompt leaves the engine untouched.
        token_lists = [self._prompt_token_ids(p) for p in prompts]
        for token_ids, params in zip(token_lists, sampling_params):
            self.engine.validate(token_ids, params)
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.resolve_lora(lora)
        outputs: dict[str, CompletionOutput] = {}
        order = []
        for token_ids, params, lora, urgency in zip(token_lists, sampling_params, loras, priorities):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, token_ids, params, lora=lora, priority=urgency)
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
