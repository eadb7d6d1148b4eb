"""An engine's adapters: which one each request runs under, and what the HTTP layer loads and unloads.

The engine holds a ``LoraManager`` when ``enable_lora`` is set. A request's
adapter is resolved when it is added (``resolve``): by name, or by a
``LoRARequest``'s name and path, loaded on first use. The request then holds
its ``AdapterId`` (so its block hashes chain from that adapter's root) and,
once admitted (``start``), a use of the adapter's weights, given back when it
ends (``finish``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pd.lora import AdapterId, LoRARequest
from pd.lora.adapter import LoraAdapter, load_adapter
from pd.lora.registry import LoraRegistry, UnknownAdapter
from pd.model.config import ModelConfig

if TYPE_CHECKING:
    from pd.config import EngineConfig
    from pd.engine.request import Request

__all__ = ["LoraManager", "UnknownAdapter", "make_lora_manager", "no_lora_error"]


def no_lora_error(name: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r} was asked for, but this engine runs without adapters: "
                      "set enable_lora: true")


def make_lora_manager(config: EngineConfig, model: ModelConfig,
                      loader: Callable[..., LoraAdapter] = load_adapter) -> LoraManager | None:
    """An engine's adapters, with ``enable_lora``; ``ValueError`` for a model they cannot adapt."""
    if not config.enable_lora:
        return None
    if model.mla is not None:
        raise ValueError(f"enable_lora: LoRA on multi-head latent attention ({model.architecture}) is not "
                         "supported")
    if config.expert_parallel_size > 1:
        raise ValueError("enable_lora with expert_parallel_size > 1 is not supported yet")
    return LoraManager(config, model, loader)


class LoraManager:
    def __init__(self, config: EngineConfig, model: ModelConfig, loader: Callable[..., LoraAdapter] = load_adapter):
        """``loader`` reads an adapter (``load_adapter``; the simulator's knows sizes only)."""
        self.registry = LoraRegistry(model, config.max_lora_rank, config.cpu_loras, loader)
        self.num_requests: dict[str, int] = {}  # requests started per adapter name, for the metrics
        for name, path in (config.lora_modules or {}).items():
            self.registry.add(name, path)

    def resolve(self, lora: LoRARequest | str) -> AdapterId:
        """The adapter ``lora`` names (a ``LoRARequest``, loaded on first use, or a loaded adapter's name)."""
        if isinstance(lora, LoRARequest):
            return self.registry.resolve(lora.lora_name, lora.lora_path)
        return self.registry.resolve(lora)

    def start(self, request: Request) -> None:
        """``request`` runs under its adapter (``request.lora``, from ``resolve``): it holds the adapter's
        weights until ``finish``."""
        self.registry.acquire(request.lora)
        self.num_requests[request.lora.name] = self.num_requests.get(request.lora.name, 0) + 1

    def finish(self, request: Request) -> None:
        if request.lora is not None:
            self.registry.release(request.lora)

    def load(self, name: str, path: str | Path) -> str:
        """Load (or reload) ``name`` from ``path``; its digest. ``ValueError`` naming what is wrong."""
        return self.registry.add(name, path).digest

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check the adapter at ``path`` without registering it (any thread): for ``add``."""
        return self.registry.read(name, path)

    def add(self, name: str, path: str | Path, adapter: LoraAdapter) -> str:
        """Register ``adapter`` (``read`` from ``path``) as ``name``; its digest."""
        return self.registry.add(name, path, adapter).digest

    def digest_of(self, name: str) -> str | None:
        """The digest of the weights ``name`` now maps to; None if it is not loaded."""
        return self.registry.digest_of(name)

    def unload(self, name: str) -> int:
        """New requests for ``name`` are refused from now; the running ones (returned) finish on it."""
        return self.registry.remove(name)

    def adapters(self) -> dict[str, str]:
        """Each loaded adapter's name and path."""
        return self.registry.names()

    def counters(self) -> dict[str, int]:
        return {"num_loras_loaded": len(self.registry.names()), "num_loras_in_memory": self.registry.num_in_memory,
                "num_lora_loads": self.registry.num_loads}
