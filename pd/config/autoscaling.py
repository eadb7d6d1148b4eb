"""The pools' SLO planner settings (``prefill.autoscaling``, ``decode.autoscaling``) and the strict base model.

``pd.config.app`` builds the app's schema from these.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

PLANNER_POLICY = "autoscale.serve:PlannerPolicy"


class StrictModel(BaseModel):
    """Unknown fields refused, so a typo fails naming the field; frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolAutoscalingArgs(StrictModel):
    """The SLO planner (``autoscale.serve.PlannerPolicy``) sizes the pool; see ``autoscale.planner``."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    period_s: float = Field(10.0, gt=0, description="between plans; replicas report twice a period")
    scale_down_delay_s: float = Field(60.0, ge=0)
    hysteresis: float = Field(0.2, ge=0, lt=1)
    forecast_periods: float = Field(2.0, ge=0)
    smoothing: float = Field(0.5, gt=0, le=1)
    correction_smoothing: float = Field(0.3, gt=0, le=1)

    @model_validator(mode="after")
    def _valid_bounds(self) -> "PoolAutoscalingArgs":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"initial_replicas ({initial}) must be within min_replicas and max_replicas")
        return self

    def _planner_fields(self, *pool_fields: str) -> dict[str, Any]:
        """The ``PlannerConfig`` fields: all but the bounds (Serve's) and the pool's SLO and capacity."""
        return self.model_dump(exclude={"min_replicas", "max_replicas", "initial_replicas", *pool_fields})

    def policy_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def serve_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config``: Serve's own delays off (the planner has its own), metrics per period."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.initial_replicas,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "metrics_interval_s": self.period_s / 2,
            "look_back_period_s": self.period_s,
            "policy": {"policy_function": PLANNER_POLICY, "policy_kwargs": self.policy_kwargs()},
        }


class PrefillAutoscalingArgs(PoolAutoscalingArgs):
    slo_ttft_s: float = Field(gt=0, description="the TTFT p90 the pool is sized for")
    backlog_drain_s: float = Field(10.0, gt=0)
    prefill_tokens_per_s: float | None = Field(None, gt=0, description="one replica's; measured when unset")

    def policy_kwargs(self) -> dict[str, Any]:
        capacity = {"prefill_tokens_per_s": self.prefill_tokens_per_s} if self.prefill_tokens_per_s else {}
        return {"pool": "prefill", "slo_s": self.slo_ttft_s, "capacity": capacity,
                "planner": self._planner_fields("slo_ttft_s", "prefill_tokens_per_s")}


class DecodeAutoscalingArgs(PoolAutoscalingArgs):
    slo_itl_s: float = Field(gt=0, description="the inter-token latency p90 the pool is sized for")
    decode_utilization: float = Field(0.8, gt=0, le=1)
    decode_step_s: float | None = Field(None, ge=0, description="a decode step's fixed time; measured when unset")
    decode_step_per_seq_s: float | None = Field(None, gt=0, description="and its time per sequence")

    @model_validator(mode="after")
    def _both_or_neither(self) -> "DecodeAutoscalingArgs":
        if (self.decode_step_s is None) != (self.decode_step_per_seq_s is None):
            raise ValueError("set decode_step_s and decode_step_per_seq_s together, or neither (measured)")
        return self

    def policy_kwargs(self) -> dict[str, Any]:
        capacity = ({"decode_step_s": self.decode_step_s, "decode_step_per_seq_s": self.decode_step_per_seq_s}
                    if self.decode_step_s is not None else {})
        return {"pool": "decode", "slo_s": self.slo_itl_s, "capacity": capacity,
                "planner": self._planner_fields("slo_itl_s", "decode_step_s", "decode_step_per_seq_s")}
