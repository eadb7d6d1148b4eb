"""The one configuration schema of the serving app: ``build_app(args)`` validates ``args`` here.

Pydantic with ``extra="forbid"`` everywhere, so a typo in a YAML file fails
``serve run`` with a message naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pd.config import EngineConfig

PREFILL_ROUTER = "router.serve:PrefixAffinityRouter"
DECODE_ROUTER = "router.serve:DecodeLoadRouter"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineArgs(_Strict):
    """Fields of ``pd.config.EngineConfig`` that a deployment may set."""

    model: str = "builtin:tiny-llama"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    block_size: int = Field(16, ge=1)
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_bytes: int = Field(512 * 1024**2, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    seed: int = 0

    def engine_config(self, kv_lease_s: float, kv_read_timeout_s: float) -> EngineConfig:
        return EngineConfig(**self.model_dump(), kv_lease_s=kv_lease_s, kv_read_timeout_s=kv_read_timeout_s)


class RouterArgs(_Strict):
    """A Ray Serve ``RequestRouter`` for one pool, as ``module:Class`` plus its kwargs."""

    request_router_class: str | None = Field(
        None, description="module:Class; defaults to PrefixAffinityRouter (prefill) or DecodeLoadRouter (decode)"
    )
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)
    request_routing_stats_period_s: float = Field(1.0, gt=0)


class PoolArgs(_Strict):
    num_replicas: int | None = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.5})
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(256, ge=-1)
    router: RouterArgs = Field(default_factory=RouterArgs)

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> "PoolArgs":
        if self.autoscaling_config is not None and self.num_replicas not in (None, 1):
            raise ValueError("set num_replicas or autoscaling_config, not both")
        return self

    def deployment_options(self, default_router: str) -> dict[str, Any]:
        from ray.serve.config import RequestRouterConfig

        options: dict[str, Any] = {
            "ray_actor_options": dict(self.ray_actor_options),
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "request_router_config": RequestRouterConfig(
                request_router_class=self.router.request_router_class or default_router,
                request_router_kwargs=dict(self.router.request_router_kwargs),
                request_routing_stats_period_s=self.router.request_routing_stats_period_s,
            ),
        }
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            options["num_replicas"] = self.num_replicas
        return options


class IngressArgs(_Strict):
    num_replicas: int = Field(1, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.25})
    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: int = Field(512, ge=-1)


class AppArgs(_Strict):
    """Everything ``serve run`` may set for the ``pd`` app."""

    model_name: str | None = Field(None, description="the id served at /v1/models; defaults to engine.model")
    engine: EngineArgs = Field(default_factory=EngineArgs)
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PoolArgs = Field(default_factory=PoolArgs)
    decode: PoolArgs = Field(default_factory=PoolArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)
    transfer_backend: Literal["nixl", "torch"] = "nixl"
    # torch backend: the port each prefill replica's TCPStore listens on (0: any free port).
    # Fix it to firewall the store: allow it only from decode nodes.
    torch_store_port: int = Field(0, ge=0, le=65535)
    # Prompts with at most this many uncached tokens prefill on the decode replica.
    remote_prefill_threshold: int = Field(256, ge=0)
    # Above this many requests in flight to the prefill pool, prefill locally instead.
    prefill_queue_bound: int = Field(32, ge=1)
    prefill_timeout_s: float = Field(30.0, gt=0)
    kv_lease_s: float = Field(30.0, gt=0)
    kv_read_timeout_s: float = Field(10.0, gt=0)
    # Bearer keys; more come from the environment variable named by api_keys_env (comma-separated),
    # as the ingress replica's process inherits it from its Ray node. Not through a runtime_env:
    # Ray's runtime-env agent writes env_vars to its log.
    api_keys: list[str] = Field(default_factory=list, repr=False)
    api_keys_env: str = Field("PD_API_KEYS", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    max_request_body_bytes: int = Field(4 * 1024**2, ge=1024)
    # A request still running after this long is cancelled on every replica (504 or an error event).
    request_timeout_s: float = Field(600.0, gt=0)

    @classmethod
    def parse(cls, args: dict[str, Any] | None) -> "AppArgs":
        """Validated args; ``ValueError`` naming every bad field (never echoing an API key)."""
        try:
            return cls.model_validate(args or {})
        except ValidationError as exc:
            raise ValueError("invalid pd app args:\n" + describe_errors(exc)) from None

    def for_pools(self) -> dict[str, Any]:
        """The args the engine pools get: everything but the API keys, which only the ingress needs."""
        return {**self.model_dump(), "api_keys": []}

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.engine.model

    def engine_config(self):
        return self.engine.engine_config(self.kv_lease_s, self.kv_read_timeout_s)


SECRET_FIELDS = ("api_keys",)


def describe_errors(exc: ValidationError) -> str:
    """One line per error: where, what, and the offending value unless the field holds secrets."""
    lines = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "args"
        line = f"  {where}: {error['msg']}"
        secret = bool(error["loc"]) and error["loc"][0] in SECRET_FIELDS
        if not secret and "input" in error:
            line += f" (got {error['input']!r:.200})"
        lines.append(line)
    return "\n".join(lines)
