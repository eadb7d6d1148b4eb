"""The adapters an engine knows: by name, where each loads from, and their weights in host memory.

A name maps to the adapter's current weights, an ``AdapterId`` (name and
digest). Requests hold the id they started under: an adapter reloaded with
new weights serves its new requests from the new weights, while requests
already running finish on the old ones, whose KV no new request can hit.

Host memory holds at most ``max_cpu_loras`` adapters' weights, least recently
used evicted first; an evicted adapter that a request names again is read
from its path again. Weights that running requests use are never evicted, so
the bound can be passed while more adapters than it are in use at once.

Unloading a name (``remove``) refuses new requests for it at once and lets
those running finish: their weights go with the last of them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pd.lora import AdapterId
from pd.lora.adapter import LoraAdapter, load_adapter
from pd.model.config import ModelConfig

logger = logging.getLogger(__name__)


class UnknownAdapter(ValueError):
    """A request named an adapter this engine does not have (the HTTP layer answers 404)."""


@dataclass
class _Entry:
    path: str
    adapter: LoraAdapter | None  # None once evicted from host memory
    num_users: int = 0


class LoraRegistry:
    """``max_rank``: the largest rank accepted (``max_lora_rank``); ``max_cpu_loras``: adapters kept in host
    memory. ``loader`` reads an adapter (``pd.lora.adapter.load_adapter``; tests count its calls)."""

    def __init__(self, model: ModelConfig, max_rank: int, max_cpu_loras: int,
                 loader: Callable[..., LoraAdapter] = load_adapter):
        self.model = model
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._load = loader
        self._names: dict[str, AdapterId] = {}
        self._entries: OrderedDict[AdapterId, _Entry] = OrderedDict()  # least recently used first
        self.num_loads = 0  # adapters read from disk, reloads after eviction included

    def add(self, name: str, path: str | Path, adapter: LoraAdapter | None = None) -> AdapterId:
        """Load the adapter at ``path`` as ``name`` (``ValueError`` naming what is wrong with it), or take it
        already read (``adapter``); loading a name again replaces its weights for new requests."""
        adapter = adapter if adapter is not None else self._read(name, str(path))
        old = self._names.get(name)
        key = AdapterId(name, adapter.digest)
        self._names[name] = key
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Entry(str(path), adapter)
        else:
            entry.path, entry.adapter = str(path), entry.adapter or adapter
        self._entries.move_to_end(key)
        if old is not None and old != key:
            self._drop_if_unused(old)
        self._evict()
        return key

    def remove(self, name: str) -> int:
        """Forget ``name`` for new requests; how many running requests still use it (they finish on it)."""
        key = self._names.pop(name, None)
        if key is None:
            raise UnknownAdapter(f"no LoRA adapter named {name!r} is loaded")
        users = self._entries[key].num_users
        self._drop_if_unused(key)
        return users

    def path_of(self, key: AdapterId) -> str:
        """Where the weights of ``key`` were read from."""
        return self._entries[key].path

    def digest_of(self, name: str) -> str | None:
        key = self._names.get(name)
        return None if key is None else key.digest

    def names(self) -> dict[str, str]:
        """Each adapter name and the path it loads from."""
        return {name: self._entries[key].path for name, key in self._names.items()}

    def resolve(self, name: str, path: str | None = None) -> AdapterId:
        """The adapter a new request named ``name`` runs under; with ``path`` (a ``LoRARequest``'s), loaded
        now if the name is new. A known name given another path is refused: the request would silently run
        on other weights than it names."""
        key = self._names.get(name)
        if key is None:
            if path is None:
                raise UnknownAdapter(f"no LoRA adapter named {name!r} is loaded")
            return self.add(name, path)
        if path is not None and str(path) != self._entries[key].path:
            raise ValueError(f"LoRA adapter {name!r} is loaded from {self._entries[key].path}, not {path}; "
                             "unload it first, or use another name")
        return key

    def acquire(self, key: AdapterId) -> LoraAdapter:
        """A request starts under ``key``: its weights, in host memory until ``release``."""
        entry = self._entries[key]
        entry.num_users += 1
        if entry.adapter is None:
            entry.adapter = self._read(key.name, entry.path)
            if entry.adapter.digest != key.digest:  # the files changed since it was loaded under this name
                entry.num_users -= 1
                entry.adapter = None
                raise ValueError(f"LoRA adapter {key.name!r} at {entry.path} changed on disk since it was "
                                 "loaded; load it again")
        self._entries.move_to_end(key)
        self._evict()
        return entry.adapter

    def weights(self, key: AdapterId) -> LoraAdapter:
        """The weights of an adapter some request holds (``acquire``)."""
        adapter = self._entries[key].adapter
        assert adapter is not None, f"{key} is used but not in host memory"
        return adapter

    def release(self, key: AdapterId) -> None:
        entry = self._entries[key]
        entry.num_users -= 1
        self._drop_if_unused(key)
        self._evict()

    def num_users(self, name: str) -> int:
        key = self._names.get(name)
        return 0 if key is None else self._entries[key].num_users

    @property
    def num_in_memory(self) -> int:
        return sum(entry.adapter is not None for entry in self._entries.values())

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """The adapter at ``path``, read and checked by the loader, not registered (any thread)."""
        return self._load(name, str(path), self.model, self.max_rank)

    def _read(self, name: str, path: str) -> LoraAdapter:
        self.num_loads += 1
        return self.read(name, path)

    def _drop_if_unused(self, key: AdapterId) -> None:
        """Weights no name points to and no request uses are gone for good."""
        if self._entries[key].num_users == 0 and self._names.get(key.name) != key:
            del self._entries[key]

    def _evict(self) -> None:
        """Drop the least recently used unused adapters' weights past ``max_cpu_loras`` (their paths stay)."""
        excess = self.num_in_memory - self.max_cpu_loras
        for key, entry in list(self._entries.items()):
            if excess <= 0:
                break
            if entry.adapter is not None and entry.num_users == 0:
                logger.info("LoRA adapter %s evicted from host memory (max_cpu_loras %d)", key.name,
                            self.max_cpu_loras)
                entry.adapter = None
                excess -= 1
