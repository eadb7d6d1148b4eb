"""LoRA adapters in simulated time: weights that are sizes only, served by the engine's own adapter code.

A simulated engine with ``enable_lora`` runs the real ``pd.lora`` bookkeeping:
a request names its adapter (``LLMEngine.add_request(lora=name)``), the
engine's ``LoraManager`` resolves it to an ``AdapterId`` (its block hashes
chain from that adapter's root, and a KV handle names it), the scheduler
admits at most ``max_loras`` adapters among its running requests
(``pd.lora.admission``), and before each step the runner gives the step's
adapters device slots with the engine's own LRU policy
(``pd.lora.slot_table.SlotTable``). Only the weights are modelled: an
``AdapterCatalog`` names each adapter's size, is each engine's adapter
loader (``LLMEngine(lora_loader=...)``, so an adapter evicted from host
memory is read again as on a real engine) and registers every adapter with
it (``serve``); a copy into a slot costs its bytes at the host link's rate
(``CostModel.per_host_byte_s``), in the step that needs it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Sequence

from pd.engine.engine import LLMEngine
from pd.lora import AdapterId
from pd.lora.adapter import LoraAdapter
from pd.model.config import ModelConfig

ADAPTER_DTYPE_BYTES = 2  # a device slot's dtype: the model's, bf16


@dataclass(frozen=True)
class SimAdapter:
    """One adapter: its name and the bytes of its A and B weights (what a copy into a slot moves)."""

    name: str
    num_bytes: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an adapter needs a name")
        if self.num_bytes < 0:
            raise ValueError(f"adapter {self.name!r}: num_bytes must be >= 0, got {self.num_bytes}")

    @property
    def key(self) -> AdapterId:
        """Its ``AdapterId``: the digest stands for weights, so it is the name's and the size's."""
        digest = hashlib.blake2b(f"sim-adapter/{self.name}/{self.num_bytes}".encode(), digest_size=16).hexdigest()
        return AdapterId(self.name, digest)


def lora_bytes(model: ModelConfig, rank: int) -> int:
    """The bytes of a rank-``rank`` adapter of every projection of ``model``'s decoder layers, in bf16."""
    attention = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    hidden, inter = model.hidden_size, model.intermediate_size
    features = ((hidden + attention) + 2 * (hidden + kv) + (attention + hidden)  # q, k, v, o
                + 2 * (hidden + inter) + (inter + hidden))  # gate, up, down
    return features * rank * model.num_layers * ADAPTER_DTYPE_BYTES


class AdapterCatalog:
    """A deployment's adapters, by name: what the ingress hashes prompts under and the engines load."""

    def __init__(self, adapters: Sequence[SimAdapter] = ()):
        by_name: dict[str, SimAdapter] = {}
        for adapter in adapters:
            if adapter.name in by_name:
                raise ValueError(f"adapter {adapter.name!r} is named twice")
            by_name[adapter.name] = adapter
        self._by_name = MappingProxyType(by_name)
        self._bytes = MappingProxyType({adapter.key: adapter.num_bytes for adapter in adapters})

    def key(self, name: str) -> AdapterId:
        """The ``AdapterId`` a request naming ``name`` runs under; ``KeyError`` naming the adapters known."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise KeyError(f"no simulated adapter {name!r}; the catalog has {sorted(self._by_name)}")
        return adapter.key

    def __len__(self) -> int:
        return len(self._by_name)

    def load_bytes(self, keys: Iterable[AdapterId]) -> int:
        """The bytes copied to load ``keys`` into slots."""
        return sum(self._bytes[key] for key in keys)

    def adapter(self, name: str, max_rank: int) -> LoraAdapter:
        """``name``'s weights as ``pd.lora.adapter.load_adapter`` would read them: its digest and size, no
        tensors."""
        adapter = self._by_name[name]
        return LoraAdapter(name=name, path=Path(f"sim://{name}"), digest=adapter.key.digest, rank=max_rank,
                           modules={}, num_bytes=adapter.num_bytes)

    def load(self, name: str, path: str, model: ModelConfig, max_rank: int) -> LoraAdapter:
        """The engine's adapter loader (``LLMEngine(lora_loader=...)``): ``name``'s weights, from its path
        ``sim://<name>``."""
        return self.adapter(name, max_rank)

    def serve(self, engine: LLMEngine) -> None:
        """Register every adapter with ``engine``'s ``LoraManager``, read by ``load`` (again after an eviction
        from its host memory)."""
        for name in self._by_name:
            engine.lora.load(name, f"sim://{name}")


NO_ADAPTERS = AdapterCatalog()  # a deployment that serves none
