"""The app's ``flow_control:`` settings (``AppArgs.flow_control``): priority bands, tenants, shedding, saturation.

Validated here, naming the field, and turned into ``router.flow_config.FlowConfig`` (frozen dataclasses) for
``router.flow_control``. An example::

    flow_control:
      bands:                                  # most urgent first; a request's ``priority`` picks its band
        - {name: interactive, max_priority: 0, ttft_deadline_ms: 2000}
        - {name: batch, min_priority: 1}
      tenants:
        a: {weight: 1, api_keys: [sk-a]}
        b: {weight: 1, api_keys: [sk-b]}
        c: {weight: 1, default_priority: 1, quota_tokens_per_min: 600000, max_queued: 128, api_keys: [sk-c]}
      default_tenant: a                       # a request no key or trusted header names
      trust_tenant_header: false              # x-tenant-id names the tenant of a request whose key does not
      shed_margin: 0.1                        # shed when the predicted TTFT passes the deadline by 10%
      max_queued: 4096                        # waiting requests of every tenant together
      queue_reserve: 0.25                     # each band queues into 0.75 of the bound the band above may fill
      saturation: {max_waiting: 4, max_kv_usage: 0.95, max_step_s: 0.1, max_report_age_s: 3}

Tenants' API keys are secrets as ``api_keys`` are: never in a repr, an
error message or the args the pools get (``for_pools``).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, model_validator

from pd.config.autoscaling import StrictModel
from router.flow_config import NAME_PATTERN, Band, FlowConfig, SaturationConfig, Tenant, key_digest

# ``engine.low_priority_step_s`` where flow control is on and ``engine:`` sets nothing: a step of less urgent
# bands' prompts only keeps within it, so an urgent prompt arriving meanwhile waits at most about that long
# for the step in flight (``pd.engine.step_budget``; at 2x load, halved the urgent remote prefill call).
LOW_PRIORITY_STEP_S = 0.25


class BandArgs(StrictModel):
    """The requests of priorities ``min_priority..max_priority`` (inclusive; unset: unbounded)."""

    name: str = Field(pattern=NAME_PATTERN)
    min_priority: int | None = None
    max_priority: int | None = None
    ttft_deadline_ms: float | None = Field(None, gt=0, allow_inf_nan=False,
                                           description="the TTFT deadline of a request that sets no x-slo-ttft-ms")

    @model_validator(mode="after")
    def _ordered(self) -> "BandArgs":
        if self.min_priority is not None and self.max_priority is not None and self.min_priority > self.max_priority:
            raise ValueError(f"min_priority ({self.min_priority}) is above max_priority ({self.max_priority})")
        return self

    def band(self) -> Band:
        deadline = None if self.ttft_deadline_ms is None else self.ttft_deadline_ms / 1000.0
        return Band(self.name, self.min_priority, self.max_priority, deadline)


class TenantArgs(StrictModel):
    weight: float = Field(1.0, gt=0, allow_inf_nan=False, description="its fair share's weight within a band")
    default_priority: int = 0
    quota_tokens_per_min: int | None = Field(None, ge=1, description="prompt + output tokens; over it, it borrows")
    max_queued: int = Field(256, ge=0, description="its requests waiting at once; more are shed")
    api_keys: list[str] = Field(default_factory=list, repr=False, description="the bearer keys that identify it")

    @model_validator(mode="after")
    def _keys_not_empty(self) -> "TenantArgs":
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys: an empty key identifies nobody")
        return self


class SaturationArgs(StrictModel):
    """When a replica has no room, from its own routing report (``router.flow_capacity``)."""

    max_waiting: int = Field(4, ge=0, description="requests waiting in its engine's queue")
    max_kv_usage: float = Field(0.95, gt=0, le=1)
    max_backlog_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                        description="the routers' predicted prompt work queued there")
    max_step_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="the routers' predicted decode step (inter-token latency) there")
    max_report_age_s: float = Field(3.0, gt=0, allow_inf_nan=False, description="older reports count as saturated")
    band_reserve: float = Field(0.0, ge=0, lt=1, description="the share of the in-flight limit each band leaves "
                                                                  "to the bands above it")

    def config(self) -> SaturationConfig:
        return SaturationConfig(**self.model_dump())


class FlowControlArgs(StrictModel):
    """Admission at the ingress: bands, tenants' weights and quotas, deadlines and shedding
    (``router.flow_control``)."""

    bands: list[BandArgs] = Field(default_factory=lambda: [BandArgs(name="default")], min_length=1)
    tenants: dict[str, TenantArgs] = Field(default_factory=lambda: {"default": TenantArgs()}, min_length=1)
    default_tenant: str = "default"
    trust_tenant_header: bool = False
    shed_margin: float = Field(0.1, ge=0, allow_inf_nan=False,
                               description="shed when the predicted TTFT passes the deadline by this fraction of it")
    max_queued: int = Field(4096, ge=0, description="waiting requests of every tenant together")
    queue_reserve: float = Field(0.25, ge=0, lt=1, description="the share of a queue bound (a tenant's max_queued "
                                 "and max_queued) each band leaves to the bands above it")
    saturation: SaturationArgs = Field(default_factory=SaturationArgs)

    @model_validator(mode="after")
    def _valid(self) -> "FlowControlArgs":
        for name in self.tenants:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"tenants: {name[:64]!r} is not a valid tenant name (letters, digits, '_', '.', "
                                 "'-', at most 64)")
        owners: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            for key in tenant.api_keys:
                if owners.setdefault(key, name) != name:
                    raise ValueError(f"tenants: an API key of tenant {name!r} is also one of tenant {owners[key]!r}; "
                                     "a key identifies one tenant")
        self.config()  # the core's own checks: bands in order, the default tenant, default priorities
        return self

    def config(self) -> FlowConfig:
        """The core's settings; ``ValueError`` where they do not hold together."""
        tenants = tuple(Tenant(name, tenant.weight, tenant.default_priority, tenant.quota_tokens_per_min,
                               tenant.max_queued) for name, tenant in self.tenants.items())
        key_tenants = {key_digest(key): name for name, tenant in self.tenants.items() for key in tenant.api_keys}
        return FlowConfig(bands=tuple(band.band() for band in self.bands), tenants=tenants,
                          default_tenant=self.default_tenant, trust_tenant_header=self.trust_tenant_header,
                          shed_margin=self.shed_margin, max_queued=self.max_queued,
                          queue_reserve=self.queue_reserve, saturation=self.saturation.config(),
                          key_tenants=key_tenants)

    def api_keys(self) -> list[str]:
        """Every tenant's keys: the ingress accepts them as it accepts ``AppArgs.api_keys``."""
        return [key for tenant in self.tenants.values() for key in tenant.api_keys]

    def ingress_max_ongoing(self, ingress_max_ongoing: int, explicit: bool) -> int:
        """The ingress replica's ``max_ongoing_requests`` under flow control: its waiting requests are ongoing
        HTTP requests, and beyond the bound Serve's proxy would queue them where flow control cannot see them.
        Unset, it rises to ``max_queued`` plus the default's room for those in flight; set, it must hold them."""
        if not explicit:
            return max(ingress_max_ongoing, self.max_queued + ingress_max_ongoing)
        if ingress_max_ongoing <= self.max_queued:
            raise ValueError(f"ingress.max_ongoing_requests ({ingress_max_ongoing}) must be above "
                             f"flow_control.max_queued ({self.max_queued}): requests waiting in flow control are "
                             "ongoing requests of the ingress, and past its bound they would queue unseen")
        return ingress_max_ongoing

    def for_pools(self) -> dict[str, Any]:
        """These settings without the tenants' keys, which only the ingress needs."""
        dumped = self.model_dump()
        for tenant in dumped["tenants"].values():
            tenant["api_keys"] = []
        return dumped
