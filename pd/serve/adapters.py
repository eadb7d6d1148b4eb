"""The LoRA adapters an ingress serves: a request's ``model`` names one, ``/v1/models`` lists them.

The table starts from ``engine.lora_modules`` and changes with
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. Each entry is the
adapter's path and the digest of the weights the ingress read and checked
there (``pd.lora.adapter``); a request carries both to the pools
(``LoraRef``), so any replica can serve it, loading the adapter first if it
holds other weights under the name or none, and its block hashes chain from
that adapter's root everywhere.

Each ingress replica keeps its own table: with ``ingress.num_replicas`` above
1, a load or unload reaches the ingress replica that receives it (and every
engine replica), not the other ingress replicas.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pd.model.config import ModelConfig
from pd.serve.openai_protocol import OpenAIError
from pd.serve.protocol import LoraRef
from router.protocol import RouteHints


class AdapterTable:
    def __init__(self, base_name: str, model: ModelConfig, max_rank: int, enabled: bool,
                 modules: dict[str, str] | None = None):
        self.base_name = base_name
        self.model, self.max_rank, self.enabled = model, max_rank, enabled
        self._refs: dict[str, LoraRef] = {}
        for name, path in (modules or {}).items():
            self.add(name, path)

    def resolve(self, model: str) -> LoraRef | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a name served by no one."""
        if model == self.base_name:
            return None
        ref = self._refs.get(model)
        if ref is None:
            served = [self.base_name, *sorted(self._refs)]
            raise OpenAIError(404, f"model {model!r} does not exist; this server has {served}", param="model",
                              code="model_not_found")
        return ref

    def read(self, name: str, path: str) -> LoraRef:
        """Read and check the adapter at ``path`` (slow: a worker thread's); 400 naming what is wrong."""
        if not self.enabled:
            raise OpenAIError(400, "this server runs without LoRA adapters: set engine.enable_lora: true",
                              param="lora_name")
        if not name or name == self.base_name:
            raise OpenAIError(400, f"lora_name {name!r} must be a non-empty name other than the base model's",
                              param="lora_name")
        from pd.lora.adapter import load_adapter  # torch: loaded by an ingress that serves adapters only

        try:
            adapter = load_adapter(name, path, self.model, self.max_rank)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="lora_path") from None
        return LoraRef(name=name, path=str(Path(path)), digest=adapter.digest)

    def add(self, name: str, path: str) -> LoraRef:
        ref = self._refs[name] = self.read(name, path)
        return ref

    def put(self, ref: LoraRef) -> None:
        self._refs[ref.name] = ref

    def remove(self, name: str) -> LoraRef:
        ref = self._refs.pop(name, None)
        if ref is None:
            raise OpenAIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                              code="model_not_found")
        return ref

    def models(self, created: int) -> list[dict]:
        """``/v1/models``' entries: the base model, then each adapter with its ``parent`` (as vLLM lists them)."""
        base = {"id": self.base_name, "object": "model", "created": created, "owned_by": "pd", "root": self.base_name,
                "parent": None}
        return [base, *({"id": ref.name, "object": "model", "created": created, "owned_by": "pd", "root": ref.path,
                         "parent": self.base_name} for ref in sorted(self._refs.values(), key=lambda r: r.name))]


class AdapterControl:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: the ingress's table, and every replica of
    both pools told, each reached by its id; the answer reports each replica."""

    def __init__(self, table: AdapterTable, pools: dict[str, object]):
        self.table = table
        self.pools = {name: handle for name, handle in pools.items() if handle is not None}

    async def load(self, name: str, path: str) -> dict:
        """Read and check the adapter here (400 naming the problem), then have every replica load it."""
        ref = await asyncio.to_thread(self.table.read, name, path)
        replicas = await self._tell("load_lora_of", ref)
        self.table.put(ref)
        return {"lora_name": name, "lora_path": ref.path, "digest": ref.digest, "replicas": replicas}

    async def unload(self, name: str) -> dict:
        """New requests naming ``name`` get 404 from now; each replica's running requests on it finish there."""
        ref = self.table.remove(name)
        return {"lora_name": name, "replicas": await self._tell("unload_lora_of", ref)}

    async def _tell(self, method: str, ref: LoraRef) -> list[dict]:
        calls = []
        for pool, handle in self.pools.items():
            for replica_id in _replica_ids(handle):
                hints = RouteHints(request_id="", target_replica_id=replica_id).encode()
                calls.append((pool, replica_id, getattr(handle, method).remote(hints, ref.encode())))
        reports = []
        for pool, replica_id, call in calls:
            try:
                reports.append({"pool": pool, **await call})
            except Exception as exc:  # noqa: BLE001 - one replica's failure is reported, not the whole call's
                reports.append({"pool": pool, "replica_id": replica_id, "error": str(exc).splitlines()[-1][:500]})
        return reports


def _replica_ids(handle) -> list[str]:
    """The live replicas of the deployment ``handle`` calls, from their named actors."""
    import ray

    prefix = f"SERVE_REPLICA::{handle.app_name}#{handle.deployment_name}#"
    return [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]
