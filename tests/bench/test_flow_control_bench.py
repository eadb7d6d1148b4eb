"""bench.flow_control's app args: every run's flow_control and app args validate as the app's would."""

from __future__ import annotations

from bench.flow_control import app_args, flow_control_args, merged
from pd.config.app import AppArgs


def test_every_runs_args_validate_and_name_the_tenants_by_key():
    for flow in (flow_control_args(), flow_control_args(shedding=False), flow_control_args(600_000), None):
        args = AppArgs.parse(app_args(flow))
        assert (args.flow_control is None) == (flow is None)
    config = AppArgs.parse(app_args(flow_control_args(600_000))).flow_control.config()
    assert config.tenant("c").quota_tokens_per_min == 600_000 and config.tenant("a").quota_tokens_per_min is None
    assert config.shed_margin == 0.1 and AppArgs.parse(app_args(flow_control_args(shedding=False))) \
        .flow_control.config().shed_margin > 1e6


def test_overrides_merge_section_by_section():
    base = {"engine": {"model": "m", "dtype": "float32"}, "mode": "disaggregated"}
    assert merged(base, {"engine": {"kv_cache_bytes": 1}}) == {
        "engine": {"model": "m", "dtype": "float32", "kv_cache_bytes": 1}, "mode": "disaggregated"}
