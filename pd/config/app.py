"""The one configuration schema of the serving app: ``build_app(args)`` validates ``args`` here.

Pydantic with ``extra="forbid"`` everywhere, so a typo in a YAML file fails
``serve run`` with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any, Literal

from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from pd.config import EngineConfig
from pd.config.autoscaling import DecodeAutoscalingArgs, PoolAutoscalingArgs, PrefillAutoscalingArgs, StrictModel
from pd.config.errors import describe_errors
from pd.config.flow_control import LOW_PRIORITY_STEP_S, FlowControlArgs
from router.remote_prefill import RemotePrefillRule
from router.shared import DECODE_SCOPE, PREFILL_SCOPE

# The prefill pool's default router: the prompt where its first token is predicted soonest (``router.latency``);
# AFFINITY_ROUTER, the default before it, balances prefix hits against load under a bound (``router.policy``).
PREFILL_ROUTER = "router.serve:PredictedLatencyRouter"
AFFINITY_ROUTER = "router.serve:PrefixAffinityRouter"
DECODE_ROUTER = "router.serve:DecodeLoadRouter"
# EngineConfig fields set once for the whole app, not under ``engine:``.
APP_LEVEL_ENGINE_FIELDS = ("kv_lease_s", "kv_read_timeout_s")
# EngineConfig fields set per pool (``prefill:``, ``decode:``), not under ``engine:``.
POOL_LEVEL_ENGINE_FIELDS = ("tensor_parallel_size", "expert_parallel_size", "num_redundant_experts")
# Router kwargs the app sets itself: the engines' block size and the pool's routing scope.
APP_ROUTER_KWARGS = ("block_size", "max_num_batched_tokens", "num_ingress", "routing_scope", "gray_failure")
# The prefill router of the predicted remote-prefill rule, which shares its latency predictor with the ingress.
LATENCY_ROUTER = "router.serve:PredictedLatencyRouter"
# Serve's own graceful_shutdown_timeout_s, which the pools keep where nothing asks for more.
SERVE_GRACEFUL_SHUTDOWN_S = 20.0


class _EngineArgsBase(StrictModel):
    @model_validator(mode="after")
    def _valid_engine(self) -> "_EngineArgsBase":
        EngineConfig(**self.model_dump())  # the engine's own checks, with its messages
        return self

    def engine_config(self, kv_lease_s: float, kv_read_timeout_s: float, **pool_fields: int) -> EngineConfig:
        """The engine with the app's lease fields and a pool's own (``POOL_LEVEL_ENGINE_FIELDS``)."""
        return EngineConfig(**self.model_dump(), kv_lease_s=kv_lease_s, kv_read_timeout_s=kv_read_timeout_s,
                            **pool_fields)


def _engine_args_model() -> type[_EngineArgsBase]:
    """``EngineArgs``: the fields, types and defaults of ``EngineConfig``, checked by it."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {
        f.name: (hints[f.name], f.default)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in APP_LEVEL_ENGINE_FIELDS + POOL_LEVEL_ENGINE_FIELDS
    }
    model = create_model("EngineArgs", __base__=_EngineArgsBase, **fields)
    model.__doc__ = "The fields of ``pd.config.EngineConfig`` that a deployment may set, under ``engine:``."
    return model


EngineArgs = _engine_args_model()


class RouterArgs(StrictModel):
    """A Ray Serve ``RequestRouter`` for one pool, as ``module:Class`` plus its kwargs.

    For this project's routers the kwargs are the fields of the router's
    ``policy_config`` (checked when the args are), less ``block_size``, which
    comes from ``engine.block_size``.
    """

    request_router_class: str | None = Field(
        None, description="module:Class; defaults to PredictedLatencyRouter (prefill) or DecodeLoadRouter (decode)"
    )
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)
    request_routing_stats_period_s: float = Field(1.0, gt=0)
    # Quarantine replicas that are alive but persistently slow (``router.gray.GrayFailureConfig``'s
    # fields; {} takes its defaults: 3x the pool's median over 10 s). Off when absent.
    gray_failure: dict[str, float] | None = None

    @field_validator("gray_failure")
    @classmethod
    def _valid_gray_failure(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            from router.gray import GrayFailureConfig

            try:
                GrayFailureConfig(**value)
            except TypeError as exc:
                raise ValueError(f"gray_failure: {exc}") from None
        return value

    def router_class(self, default: str) -> type:
        path = self.request_router_class or default
        module, _, name = path.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"request_router_class {path!r} cannot be imported: {exc}") from None

    def router_kwargs(self, default: str, block_size: int, routing_scope: str,
                      max_num_batched_tokens: int = 2048, num_ingress: int = 1) -> dict[str, Any]:
        """The kwargs Serve passes the router; ``ValueError`` naming a field its policy does not take.

        The app sets ``block_size`` and, where the policy takes them, ``max_num_batched_tokens`` (the engines')
        and ``num_ingress`` (the ingress replicas, each routing its own requests).
        """
        from router.serve import PinnedRequestRouter

        router_class = self.router_class(default)
        kwargs = dict(self.request_router_kwargs)
        if not (isinstance(router_class, type) and issubclass(router_class, PinnedRequestRouter)):
            return kwargs  # a foreign router: its kwargs are its own business
        for name in APP_ROUTER_KWARGS:
            if name in kwargs:
                raise ValueError(f"request_router_kwargs.{name} is set by the app (from engine.block_size "
                                 "and the pool); remove it")
        config_class = router_class.policy_config
        known = {f.name for f in dataclasses.fields(config_class)} - set(APP_ROUTER_KWARGS) if config_class else set()
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"request_router_kwargs.{unknown[0]}: not a field of {router_class.__name__}'s policy "
                             f"(its fields: {', '.join(sorted(known)) or 'none'})")
        if config_class is not None:
            fields = {f.name for f in dataclasses.fields(config_class)}
            app_set = {"block_size": block_size, **{name: value for name, value in (
                ("max_num_batched_tokens", max_num_batched_tokens), ("num_ingress", num_ingress)) if name in fields}}
            try:
                config_class(**kwargs, **app_set)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"request_router_kwargs: {exc}") from None
            kwargs.update(app_set)
        kwargs["routing_scope"] = routing_scope
        if self.gray_failure is not None:
            kwargs["gray_failure"] = dict(self.gray_failure)
        return kwargs


class PoolArgs(StrictModel):
    num_replicas: int | None = Field(1, ge=1)
    # Ray Serve's own autoscaling (its queue-length policy unless a policy is named).
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.5})
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(256, ge=-1)
    # How long Serve lets a replica that is going away finish its work before it is killed.
    graceful_shutdown_timeout_s: float | None = Field(None, gt=0)
    # How often Serve calls a replica's health check (which also checks its tensor-parallel ranks),
    # and how long one may take; Serve replaces a replica after three failed checks in a row.
    health_check_period_s: float | None = Field(None, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    router: RouterArgs = Field(default_factory=RouterArgs)
    autoscaling: PoolAutoscalingArgs | None = None
    # Ranks each replica shards the model over: the replica's actor is rank 0 and starts ranks
    # 1..N-1 as Ray actors in its placement group (STRICT_PACK, one bundle of ray_actor_options'
    # CPUs and GPUs per rank).
    tensor_parallel_size: int = Field(1, ge=1)
    # Ranks each replica spreads a mixture-of-experts model's experts over (expert parallelism);
    # attention runs on the same ranks, split (tensor_parallel_size equal to it) or whole on each
    # (tensor_parallel_size 1). The replica has max(tensor_parallel_size, expert_parallel_size) ranks.
    expert_parallel_size: int = Field(1, ge=1)
    # Replicas beyond one per expert, which EPLB gives to this pool's busiest experts.
    num_redundant_experts: int = Field(0, ge=0)

    @property
    def num_ranks(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def engine_fields(self) -> dict[str, int]:
        """This pool's own ``EngineConfig`` fields (``POOL_LEVEL_ENGINE_FIELDS``)."""
        return {name: getattr(self, name) for name in POOL_LEVEL_ENGINE_FIELDS}

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> "PoolArgs":
        if self.autoscaling_config is not None and self.autoscaling is not None:
            raise ValueError("set autoscaling (the SLO planner) or autoscaling_config (Ray's policy), not both")
        if (self.autoscaling_config is not None or self.autoscaling is not None) and self.num_replicas not in (None, 1):
            name = "autoscaling_config" if self.autoscaling_config is not None else "autoscaling"
            raise ValueError(f"set num_replicas or {name}, not both")
        return self

    def deployment_options(self, default_router: str, block_size: int, routing_scope: str,
                           graceful_shutdown_timeout_s: float | None = None,
                           max_num_batched_tokens: int = 2048, num_ingress: int = 1) -> dict[str, Any]:
        from ray.serve.config import RequestRouterConfig

        options: dict[str, Any] = {
            "ray_actor_options": dict(self.ray_actor_options),
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "request_router_config": RequestRouterConfig(
                request_router_class=self.router.request_router_class or default_router,
                request_router_kwargs=self.router.router_kwargs(default_router, block_size, routing_scope,
                                                                max_num_batched_tokens, num_ingress),
                request_routing_stats_period_s=self.router.request_routing_stats_period_s,
            ),
        }
        if graceful_shutdown_timeout_s is not None:
            options["graceful_shutdown_timeout_s"] = graceful_shutdown_timeout_s
        options.update({name: value for name in ("health_check_period_s", "health_check_timeout_s")
                        if (value := getattr(self, name)) is not None})
        if self.num_ranks > 1:
            options["placement_group_bundles"] = [self.rank_bundle()] * self.num_ranks
            options["placement_group_strategy"] = "STRICT_PACK"
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.serve_config()
        elif self.autoscaling_config is not None:
            options["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            options["num_replicas"] = self.num_replicas
        return options


    def rank_bundle(self) -> dict[str, float]:
        """What one rank holds: the CPUs and GPUs of ``ray_actor_options`` (the replica's actor is rank 0)."""
        bundle = {"CPU": float(self.ray_actor_options.get("num_cpus", 1))}
        if self.ray_actor_options.get("num_gpus"):
            bundle["GPU"] = float(self.ray_actor_options["num_gpus"])
        return bundle


class PrefillPoolArgs(PoolArgs):
    autoscaling: PrefillAutoscalingArgs | None = None


class DecodePoolArgs(PoolArgs):
    autoscaling: DecodeAutoscalingArgs | None = None


class IngressArgs(StrictModel):
    num_replicas: int = Field(1, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.25})
    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: int = Field(512, ge=-1)


class AppArgs(StrictModel):
    """Everything ``serve run`` may set for the ``pd`` app."""

    model_name: str | None = Field(None, description="the id served at /v1/models; defaults to engine.model")
    engine: EngineArgs = Field(default_factory=EngineArgs)
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PrefillPoolArgs = Field(default_factory=PrefillPoolArgs)
    decode: DecodePoolArgs = Field(default_factory=DecodePoolArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)
    transfer_backend: Literal["nixl", "torch"] = "nixl"
    # torch backend: the port each prefill replica's TCPStore listens on (0: any free port).
    # Fix it to firewall the store: allow it only from decode nodes.
    torch_store_port: int = Field(0, ge=0, le=65535)
    # nixl backend: the network devices UCX may open sockets on (UCX_NET_DEVICES, e.g. "lo" or
    # "eth0"); None leaves UCX's default, every usable device. Single-node apps want "lo".
    ucx_net_devices: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:,-]+$")
    # Prompts with at most this many uncached tokens prefill on the decode replica.
    remote_prefill_threshold: int = Field(256, ge=0)
    # ... plus this many per prefill call in flight: the bar rises as the prefill pool fills.
    remote_prefill_threshold_per_in_flight: float = Field(0.0, ge=0)
    # Above this many requests in flight to the prefill pool, prefill locally instead.
    prefill_queue_bound: int = Field(32, ge=1)
    # Decide by predicted latency instead (router.remote_prefill), once the predictions have data; the
    # threshold decides until then. Its prefill router is the predicted-latency one.
    remote_prefill_predicted: bool = False
    # Seconds of TTFT a second of decodes stalled by a local prefill is worth, under the predicted rule.
    remote_prefill_stall_weight: float = Field(1.0, ge=0)
    # A prefill call's deadline for each max_num_batched_tokens of its prompt (prefill_deadline_s).
    prefill_timeout_s: float = Field(30.0, gt=0)
    kv_lease_s: float = Field(30.0, gt=0)
    kv_read_timeout_s: float = Field(10.0, gt=0)
    # Bearer keys; more come from the environment variable named by api_keys_env (comma-separated),
    # as the ingress replica's process inherits it from its Ray node. Not through a runtime_env:
    # Ray's runtime-env agent writes env_vars to its log.
    api_keys: list[str] = Field(default_factory=list, repr=False)
    api_keys_env: str = Field("PD_API_KEYS", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    max_request_body_bytes: int = Field(4 * 1024**2, ge=1024)
    # Stop strings per request, and their total length in characters: each new piece of
    # text is scanned once per stop string, so a client's list must not cost others time.
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(4096, ge=0)
    # The most choices one request may ask for (``n``, and ``best_of`` on completions).
    max_n: int = Field(8, ge=1, le=128)
    # How many times one stream may move to another decode replica when its replica is lost.
    max_migrations: int = Field(1, ge=0)
    # Threads that tokenize prompts and render chat templates, off the ingress's event loop.
    tokenizer_threads: int = Field(2, ge=1)
    # A request still running after this long is cancelled on every replica (504 or an error event).
    request_timeout_s: float = Field(600.0, gt=0)
    # Timelines of the last this many requests, per ingress replica, for GET /debug/requests/{id} (0: none).
    debug_requests_kept: int = Field(1000, ge=0, le=100_000)
    # OpenTelemetry traces of every request over OTLP/HTTP to this collector (vLLM's --otlp-traces-endpoint).
    otlp_traces_endpoint: str | None = Field(None, pattern=r"^https?://")
    # Admission at the ingress: bands, tenants' weights and quotas, deadlines, shedding (pd.config.flow_control).
    flow_control: FlowControlArgs | None = None

    @model_validator(mode="after")
    def _valid_routers(self) -> "AppArgs":
        for name, pool, default, scope in self.pools():
            try:
                pool.router.router_kwargs(default, self.engine.block_size, scope, self.engine.max_num_batched_tokens)
            except ValueError as exc:
                raise ValueError(f"{name}.router.{exc}") from None
        if self.remote_prefill_predicted:
            from router.serve import PredictedLatencyRouter

            if not issubclass(self.prefill.router.router_class(LATENCY_ROUTER), PredictedLatencyRouter):
                raise ValueError(f"remote_prefill_predicted needs the predicted-latency prefill router: "
                                 f"prefill.router.request_router_class {self.prefill.router.request_router_class!r} "
                                 f"is not a PredictedLatencyRouter")
        return self

    @model_validator(mode="after")
    def _valid_scaling(self) -> "AppArgs":
        if self.mode == "colocated":
            for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
                if pool.autoscaling is not None:
                    raise ValueError(f"{name}.autoscaling: the SLO planner sizes the pools of a disaggregated app; "
                                     "in colocated mode use decode.autoscaling_config (Ray Serve's policy)")
        given = self.prefill.graceful_shutdown_timeout_s
        if given is not None and given < self.prefill_drain_s:
            raise ValueError(f"prefill.graceful_shutdown_timeout_s ({given}) must be at least prefill_timeout_s + "
                             f"kv_lease_s ({self.prefill_drain_s}): a prefill replica going away serves its leased "
                             "KV until the last lease ends")
        for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if pool.num_ranks > 1 and self.mode == "disaggregated" and self.transfer_backend != "nixl":
                field = "tensor_parallel_size" if pool.tensor_parallel_size > 1 else "expert_parallel_size"
                raise ValueError(f"{name}.{field} {getattr(pool, field)}: the {self.transfer_backend} transfer "
                                 "backend moves whole blocks to one rank only; pools of engines of several ranks need "
                                 "transfer_backend: nixl")
            try:
                EngineConfig(**self.engine.model_dump(), **pool.engine_fields())
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if self.decode.autoscaling is not None and self.max_migrations < 1:
            raise ValueError("decode.autoscaling needs max_migrations >= 1: a stream still running when its replica's "
                             "graceful_shutdown_timeout_s ends moves to another decode replica")
        return self

    @property
    def prefill_drain_s(self) -> float:
        """The longest a prefill replica going away can hold KV: a prefill admitted last, then its lease."""
        return self.prefill_timeout_s + self.kv_lease_s

    def pools(self) -> list[tuple[str, "PoolArgs", str, str]]:
        """``(name, args, default router, routing scope)`` of each pool."""
        prefill_router = LATENCY_ROUTER if self.remote_prefill_predicted else PREFILL_ROUTER
        return [("prefill", self.prefill, prefill_router, PREFILL_SCOPE), ("decode", self.decode, DECODE_ROUTER, DECODE_SCOPE)]

    def deployment_options(self, pool: str) -> dict[str, Any]:
        """Serve options of the ``"prefill"`` or ``"decode"`` deployment, routers included."""
        [(_, args, default, scope)] = [entry for entry in self.pools() if entry[0] == pool]
        graceful = args.graceful_shutdown_timeout_s
        if pool == "prefill" and graceful is None:
            graceful = max(SERVE_GRACEFUL_SHUTDOWN_S, self.prefill_drain_s)
        return args.deployment_options(default, self.engine.block_size, scope, graceful,
                                       self.engine.max_num_batched_tokens, self.ingress.num_replicas)

    @classmethod
    def parse(cls, args: dict[str, Any] | None) -> "AppArgs":
        """Validated args; ``ValueError`` naming every bad field (never echoing an API key)."""
        try:
            return cls.model_validate(args or {})
        except ValidationError as exc:
            raise ValueError("invalid pd app args:\n" + describe_errors(exc)) from None

    def for_pools(self) -> dict[str, Any]:
        """The args the engine pools get: everything but the API keys (the tenants' too), which only the ingress
        needs. With flow control, batch steps are bounded unless ``engine:`` says otherwise."""
        args = {**self.model_dump(), "api_keys": [], "flow_control": None}
        if self.flow_control is not None:
            args["flow_control"] = self.flow_control.for_pools()
            if "low_priority_step_s" not in self.engine.model_fields_set:
                args["engine"] = {**args["engine"], "low_priority_step_s": LOW_PRIORITY_STEP_S}
        return args

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.engine.model

    def engine_config(self, pool: str = "decode") -> EngineConfig:
        """The engine of a ``pool`` replica: ``engine:``, the app's lease fields, the pool's own. A prefill replica
        stops at the first token, so it never verifies drafts: it speculates not, and loads no draft model."""
        config = self.engine.engine_config(self.kv_lease_s, self.kv_read_timeout_s,
                                           **getattr(self, pool).engine_fields())
        if pool == "prefill" and config.speculative_config is not None:
            config = dataclasses.replace(config, speculative_config=None)
        return config

    def prefill_deadline_s(self, num_prompt_tokens: int) -> float:
        """How long a prefill call may take: ``prefill_timeout_s`` for each step's worth of prompt (a long one's
        chunks are that many steps of compute, which a fixed deadline would cut and send to the decode pool)."""
        return self.prefill_timeout_s * max(1, -(-num_prompt_tokens // self.engine.max_num_batched_tokens))

    def remote_prefill_rule(self) -> RemotePrefillRule:
        return RemotePrefillRule(threshold=self.remote_prefill_threshold, queue_bound=self.prefill_queue_bound,
                                 threshold_per_in_flight=self.remote_prefill_threshold_per_in_flight,
                                 predicted=self.remote_prefill_predicted,
                                 stall_weight=self.remote_prefill_stall_weight)
