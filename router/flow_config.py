"""Who sent a request and how urgent it is: flow control's settings, and a request classified by them.

    API key ──> tenant ──────────────> weight, quota, queue bound, default priority
      (else x-tenant-id, if trusted; else the default tenant)
    priority ──> band ──────────────> strict order, default TTFT deadline
      (the request's ``priority``, vLLM's: lower is more urgent; else its tenant's default)
    x-slo-ttft-ms ──> deadline      (else its band's default; else none)
    prompt + max output ──> cost, in tokens

``FlowConfig.classify`` is pure: nothing is counted or queued
(``router.flow_control`` does that). A request it cannot classify raises
``FlowRequestError`` naming the field, which the ingress answers with 400.
The YAML's ``flow_control:`` (``pd.config.flow_control``) builds a
``FlowConfig``; the simulator and tests build one directly, checked the same.

API keys are held as SHA-256 digests only: a lookup hashes the key
presented, so neither a repr nor a dict's probing reveals a configured key.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Mapping

# A tenant's and a band's name: safe in a header, a metric label and a log line.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
TENANT_HEADER = "x-tenant-id"
SLO_TTFT_HEADER = "x-slo-ttft-ms"
PRIORITY_FIELD = "priority"


class FlowRequestError(ValueError):
    """A request flow control cannot classify: 400, naming ``field`` (a header or the body's field)."""

    status = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def key_digest(api_key: str) -> bytes:
    """What a configured API key is held and looked up as."""
    return hashlib.sha256(api_key.encode()).digest()


@dataclass(frozen=True)
class Band:
    """Requests of priorities ``min_priority..max_priority`` (inclusive; None: unbounded on that side)."""

    name: str
    min_priority: int | None = None
    max_priority: int | None = None
    ttft_deadline_s: float | None = None  # the deadline of a request that names none

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a band needs a name")
        if self.min_priority is not None and self.max_priority is not None and self.min_priority > self.max_priority:
            raise ValueError(f"band {self.name!r}: min_priority {self.min_priority} is above max_priority "
                             f"{self.max_priority}")
        if self.ttft_deadline_s is not None and not (math.isfinite(self.ttft_deadline_s) and self.ttft_deadline_s > 0):
            raise ValueError(f"band {self.name!r}: ttft_deadline_s must be > 0, got {self.ttft_deadline_s}")

    def takes(self, priority: int) -> bool:
        return ((self.min_priority is None or priority >= self.min_priority)
                and (self.max_priority is None or priority <= self.max_priority))

    def describe(self) -> str:
        low = "-inf" if self.min_priority is None else str(self.min_priority)
        high = "inf" if self.max_priority is None else str(self.max_priority)
        return f"{self.name} [{low}, {high}]"


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0  # its share of a band's capacity among the tenants waiting in it
    default_priority: int = 0
    quota_tokens_per_min: int | None = None  # prompt + output tokens; over it, it borrows (router.flow_control)
    max_queued: int = 256  # its requests waiting at once; more are shed

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")
        if self.quota_tokens_per_min is not None and self.quota_tokens_per_min < 1:
            raise ValueError(f"tenant {self.name!r}: quota_tokens_per_min must be >= 1 or None, "
                             f"got {self.quota_tokens_per_min}")
        if self.max_queued < 0:
            raise ValueError(f"tenant {self.name!r}: max_queued must be >= 0, got {self.max_queued}")


@dataclass(frozen=True)
class SaturationConfig:
    """When a replica has no room, from its own report (``router.flow_capacity``)."""

    max_waiting: int = 4  # requests waiting in its engine's queue
    max_kv_usage: float = 0.95  # the share of its KV blocks in use
    max_backlog_s: float | None = None  # the routers' predicted prompt work queued there, in seconds; None: unused
    max_step_s: float | None = None  # its predicted decode step (inter-token latency) at its decodes; None: unused
    max_report_age_s: float = 3.0  # a report older than this counts as saturated
    band_reserve: float = 0.0  # the share of the in-flight limit each level leaves to the levels above it

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not 0 < self.max_kv_usage <= 1:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {self.max_kv_usage}")
        for name in ("max_backlog_s", "max_step_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if not self.max_report_age_s > 0:
            raise ValueError(f"max_report_age_s must be > 0, got {self.max_report_age_s}")
        if not 0 <= self.band_reserve < 1:
            raise ValueError(f"band_reserve must be in [0, 1), got {self.band_reserve}")


@dataclass(frozen=True)
class FlowIdentity:
    """What the ingress reads off one request before flow control classifies it (all optional)."""

    api_key: str | None = field(default=None, repr=False)  # the bearer key presented
    tenant_header: str | None = None  # x-tenant-id
    slo_ttft_header: str | None = None  # x-slo-ttft-ms, as sent
    priority: int | None = None  # the body's ``priority``


@dataclass(frozen=True)
class FlowRequest:
    """One request as flow control sees it."""

    request_id: str
    tenant: str
    priority: int
    band: int  # index into FlowConfig.bands: 0 is the most urgent
    deadline_s: float | None  # its TTFT deadline, from arrival; None: none
    num_prompt_tokens: int
    max_output_tokens: int
    arrival_s: float

    @property
    def cost(self) -> int:
        """What it may take, in tokens (prompt + output): what quotas, fair shares and the queue count."""
        return max(1, self.num_prompt_tokens + self.max_output_tokens)

    @property
    def deadline_at_s(self) -> float:
        """When its first token is due; infinite without a deadline."""
        return math.inf if self.deadline_s is None else self.arrival_s + self.deadline_s


@dataclass(frozen=True)
class FlowConfig:
    """Flow control's settings: bands most urgent first, tenants, and how saturation and shedding are judged.

    ``shed_margin``: a request is shed on arrival when its predicted TTFT
    exceeds its deadline by this fraction of it (``math.inf``: deadlines
    never shed, the replay that shows what shedding spared). ``max_queued``:
    every tenant's waiting requests together. ``queue_reserve``: the share of
    each queue bound (a tenant's and ``max_queued``) that each level leaves
    to the levels above it (``router.flow_control``). ``key_tenants``: each API key's digest (``key_digest``)
    and the tenant it identifies.
    """

    bands: tuple[Band, ...] = (Band("default"),)
    tenants: tuple[Tenant, ...] = (Tenant("default"),)
    default_tenant: str = "default"
    trust_tenant_header: bool = False
    shed_margin: float = 0.1
    max_queued: int = 4096
    queue_reserve: float = 0.25
    saturation: SaturationConfig = SaturationConfig()
    key_tenants: Mapping[bytes, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.bands:
            raise ValueError("bands: at least one band is needed")
        _unique("bands", [band.name for band in self.bands])
        for above, below in zip(self.bands, self.bands[1:]):
            if above.max_priority is None or below.min_priority is None or above.max_priority >= below.min_priority:
                raise ValueError(f"bands: {above.describe()} and {below.describe()} overlap or are out of order "
                                 "(each band's priorities must lie below the next one's: lower is more urgent)")
        if not self.tenants:
            raise ValueError("tenants: at least one tenant is needed")
        _unique("tenants", [tenant.name for tenant in self.tenants])
        names = {tenant.name for tenant in self.tenants}
        if self.default_tenant not in names:
            raise ValueError(f"default_tenant {self.default_tenant!r} is not a tenant (tenants: "
                             f"{', '.join(sorted(names))})")
        for tenant in self.tenants:
            if self.band_index(tenant.default_priority) is None:
                raise ValueError(f"tenant {tenant.name!r}: default_priority {tenant.default_priority} is in no band "
                                 f"({self.describe_bands()})")
        unknown = sorted(set(self.key_tenants.values()) - names)
        if unknown:
            raise ValueError(f"key_tenants names tenants that are not configured: {', '.join(unknown)}")
        if not (math.isfinite(self.shed_margin) or self.shed_margin == math.inf) or self.shed_margin < 0:
            raise ValueError(f"shed_margin must be >= 0, got {self.shed_margin}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if not 0 <= self.queue_reserve < 1:
            raise ValueError(f"queue_reserve must be in [0, 1), got {self.queue_reserve}")

    def tenant(self, name: str) -> Tenant:
        return next(tenant for tenant in self.tenants if tenant.name == name)

    def band_index(self, priority: int) -> int | None:
        return next((index for index, band in enumerate(self.bands) if band.takes(priority)), None)

    def describe_bands(self) -> str:
        return ", ".join(band.describe() for band in self.bands)

    def classify(self, request_id: str, identity: FlowIdentity, num_prompt_tokens: int, max_output_tokens: int,
                 arrival_s: float) -> FlowRequest:
        """The request's tenant, priority, band, deadline and cost; ``FlowRequestError`` naming a bad field."""
        if num_prompt_tokens < 0 or max_output_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_prompt_tokens} and {max_output_tokens}")
        tenant = self.tenant(self._tenant_name(identity))
        priority = tenant.default_priority if identity.priority is None else identity.priority
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise FlowRequestError(PRIORITY_FIELD, f"must be an integer, got {priority!r}")
        band = self.band_index(priority)
        if band is None:
            raise FlowRequestError(PRIORITY_FIELD, f"{priority} is in no priority band ({self.describe_bands()})")
        deadline = (self.bands[band].ttft_deadline_s if identity.slo_ttft_header is None
                    else parse_slo_ttft_ms(identity.slo_ttft_header))
        return FlowRequest(request_id, tenant.name, priority, band, deadline, num_prompt_tokens, max_output_tokens,
                           arrival_s)

    def _tenant_name(self, identity: FlowIdentity) -> str:
        """By API key; else by x-tenant-id where trusted (an unknown one refused); else the default."""
        if identity.api_key:
            by_key = self.key_tenants.get(key_digest(identity.api_key))
            if by_key is not None:
                return by_key
        header = identity.tenant_header
        if header is None or not self.trust_tenant_header:
            return self.default_tenant
        if not any(tenant.name == header for tenant in self.tenants):
            raise FlowRequestError(TENANT_HEADER, f"unknown tenant {header[:64]!r}")
        return header


def parse_slo_ttft_ms(value: str) -> float:
    """``x-slo-ttft-ms`` in seconds: a positive, finite number of milliseconds."""
    try:
        ms = float(value.strip())
    except ValueError:
        raise FlowRequestError(SLO_TTFT_HEADER, f"must be a number of milliseconds, got {value[:32]!r}") from None
    if not (math.isfinite(ms) and ms > 0):
        raise FlowRequestError(SLO_TTFT_HEADER,
                               f"must be a positive, finite number of milliseconds, got {value[:32]!r}")
    return ms / 1000.0


def _unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what}: {name!r} is named twice")
        seen.add(name)
