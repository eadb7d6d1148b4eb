"""LoRA adapters served beside their base model, many in one batch.

- ``adapter``: read and validate a peft adapter directory (``load_adapter``).
- ``LoRARequest``: the adapter a request runs under, as vLLM's API names it.
- ``AdapterId``: an adapter as the KV knows it, its name and its weights' digest.
- ``registry``: the adapters an engine knows, their weights in host memory (``max_cpu_loras``, LRU).
- ``slots``: the adapters a step may use, on the device (``max_loras``).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.hashing import adapter_root_hash


@dataclass(frozen=True)
class LoRARequest:
    """Run a request under the peft adapter at ``lora_path``, known as ``lora_name``.

    The engine loads the adapter on first use (or takes it from ``lora_modules``); a name already loaded from
    another path is refused rather than silently served with the other weights.
    """

    lora_name: str
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty path, got {self.lora_path!r}")


@dataclass(frozen=True)
class AdapterId:
    """One adapter's weights: its name and their digest (``pd.lora.adapter.LoraAdapter.digest``). A request
    runs under one; its KV blocks' hashes chain from ``root_hash``."""

    name: str
    digest: str

    @property
    def root_hash(self) -> bytes:
        return adapter_root_hash(self.name, self.digest)
