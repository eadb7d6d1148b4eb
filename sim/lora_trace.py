"""A multi-LoRA trace: requests under adapters of Zipf popularity, each adapter with its own system prompt.

    adapter k (k = 1..num_adapters) is drawn with probability ∝ 1 / k^zipf_s
    prompt = adapter k's system prompt (system_prompt_tokens) + the request's own tail

Arrivals are Poisson at ``rate_per_s``. A block of a system prompt is cached
under its adapter's root (``router.hashing.adapter_root_hash``), so a prefix
hit is possible only between requests of one adapter, and at most the system
prompt's full blocks hit. ``submit_lora_trace`` hands the trace to a
``SimCluster`` whose ``adapters`` are ``trace_adapters``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from pd.sampling_params import SamplingParams
from sim.adapters import SimAdapter


@dataclass(frozen=True)
class LoraTraceConfig:
    num_adapters: int = 16
    zipf_s: float = 1.0
    num_requests: int = 2000
    rate_per_s: float = 50.0
    system_prompt_tokens: int = 1024
    tail_tokens: tuple[int, int] = (512, 4096)  # each request's own prompt tokens (a document), uniform
    output_tokens: tuple[int, int] = (32, 256)  # uniform in [low, high]
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_adapters", "num_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zipf_s < 0 or not self.rate_per_s > 0:
            raise ValueError(f"zipf_s must be >= 0 and rate_per_s > 0, got {self.zipf_s} and {self.rate_per_s}")
        for name in ("tail_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")
        if self.system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be >= 0, got {self.system_prompt_tokens}")

    def adapter_names(self) -> list[str]:
        """Most popular first."""
        return [f"lora-{rank:02d}" for rank in range(self.num_adapters)]

    def popularity(self) -> list[float]:
        """Each adapter's share of the requests, most popular first (Zipf, exponent ``zipf_s``)."""
        weights = [1.0 / (rank + 1) ** self.zipf_s for rank in range(self.num_adapters)]
        total = sum(weights)
        return [weight / total for weight in weights]


@dataclass(frozen=True)
class AdapterRequest:
    arrival_s: float
    adapter: str
    prompt: list[int]
    max_tokens: int


def generate_lora_trace(config: LoraTraceConfig, vocab_size: int) -> list[AdapterRequest]:
    """The trace, in arrival order; the same for the same config (its seed) and vocabulary."""
    rng = random.Random(config.seed)
    names = config.adapter_names()
    system = {name: [rng.randrange(vocab_size) for _ in range(config.system_prompt_tokens)] for name in names}
    weights = config.popularity()
    now_s, requests = 0.0, []
    for _ in range(config.num_requests):
        now_s += -math.log(1.0 - rng.random()) / config.rate_per_s
        name = rng.choices(names, weights)[0]
        tail = [rng.randrange(vocab_size) for _ in range(rng.randint(*config.tail_tokens))]
        requests.append(AdapterRequest(now_s, name, system[name] + tail, rng.randint(*config.output_tokens)))
    return requests


def trace_adapters(config: LoraTraceConfig, num_bytes: int) -> tuple[SimAdapter, ...]:
    """The trace's adapters, ``num_bytes`` each, for ``ClusterSpec.adapters``."""
    return tuple(SimAdapter(name, num_bytes) for name in config.adapter_names())


def submit_lora_trace(cluster, requests: Sequence[AdapterRequest]) -> None:
    """Have ``cluster`` (a ``SimCluster``) receive ``requests``: request ``i`` as ``r{i}``, run to its length."""
    for index, request in enumerate(requests):
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        cluster.loop.at(request.arrival_s, lambda index=index, request=request, params=params: cluster.submit(
            f"r{index}", request.prompt, params, adapter=request.adapter))
