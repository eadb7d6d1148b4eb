"""Every serve config validates; typos fail naming the field."""

from __future__ import annotations

import pytest

from pd.config.app import AppArgs
from pd.serve.app import build_app
from tests.serve.conftest import CONFIG_DIR, config_args

CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def test_the_documented_configs_exist():
    assert {"default.yaml", "colocated.yaml", "gpu_llama3_8b.yaml", "multinode.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates(name):
    args = AppArgs.model_validate(config_args(name))
    from ray.serve.config import RequestRouterConfig

    for pool in (args.prefill, args.decode):
        options = pool.deployment_options("router.serve:PinnedRequestRouter", args.engine.block_size, "prefill")
        assert isinstance(options["request_router_config"], RequestRouterConfig)


def test_default_config_is_the_documented_one():
    args = AppArgs.model_validate(config_args("default.yaml"))
    assert args.mode == "disaggregated" and args.transfer_backend == "nixl"
    assert args.engine.model == "builtin:smollm2-135m-instruct" and args.engine.device == "cpu"
    assert args.prefill.num_replicas == args.decode.num_replicas == args.ingress.num_replicas == 1
    assert args.api_keys == []
    assert args.decode.max_ongoing_requests >= 8 and args.prefill.max_ongoing_requests >= 8


def test_multinode_config_pins_pools_to_node_groups():
    args = AppArgs.model_validate(config_args("multinode.yaml"))
    assert args.prefill.ray_actor_options["resources"] == {"prefill_pool": 1}
    assert args.decode.ray_actor_options["resources"] == {"decode_pool": 1}


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda a: a.update(trasnfer_backend="nixl"), "trasnfer_backend"),
        (lambda a: a["engine"].update(block_sise=16), "block_sise"),
        (lambda a: a["prefill"].update(num_replicas="two"), "num_replicas"),
        (lambda a: a.update(mode="sideways"), "mode"),
        (lambda a: a.update(transfer_backend="carrier-pigeon"), "transfer_backend"),
    ],
)
def test_typos_and_bad_types_name_the_field(mutate, field):
    args = config_args("default.yaml")
    mutate(args)
    with pytest.raises(ValueError, match=field):
        build_app(args)


@pytest.mark.parametrize(
    "pool, kwargs, field",
    [
        ("prefill", {"w_prefx": 2.0}, "w_prefx"),
        ("decode", {"w_actve": 1.0}, "w_actve"),
        ("prefill", {"w_prefix": -1.0}, "w_prefix must be >= 0"),
        ("decode", {"block_size": 32}, "block_size is set by the app"),
    ],
)
def test_router_kwargs_are_checked_before_anything_starts(pool, kwargs, field):
    args = config_args("default.yaml")
    args[pool]["router"] = {"request_router_kwargs": kwargs}
    with pytest.raises(ValueError, match=f"{pool}.router.request_router_kwargs.*{field}"):
        build_app(args)


def test_router_kwargs_errors_never_echo_api_keys():
    args = {**config_args("default.yaml"), "api_keys": ["sk-secret-key"]}
    args["prefill"]["router"] = {"request_router_kwargs": {"w_prefx": 2.0}}
    with pytest.raises(ValueError) as refused:
        build_app(args)
    assert "sk-secret-key" not in str(refused.value)


def test_the_routers_get_the_engines_block_size():
    args = config_args("default.yaml")
    args["engine"]["block_size"] = 32
    parsed = AppArgs.parse(args)
    for pool in ("prefill", "decode"):
        kwargs = parsed.deployment_options(pool)["request_router_config"].request_router_kwargs
        assert kwargs["block_size"] == 32 and kwargs["routing_scope"] == pool


def test_engine_defaults_and_choices_have_one_source():
    """The YAML edge is the engine dataclass: same fields (less the app- and pool-level ones), same defaults."""
    import dataclasses
    import typing

    from pd.config import EngineConfig
    from pd.config.app import APP_LEVEL_ENGINE_FIELDS, POOL_LEVEL_ENGINE_FIELDS, EngineArgs, PoolArgs

    elsewhere = APP_LEVEL_ENGINE_FIELDS + POOL_LEVEL_ENGINE_FIELDS
    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name not in elsewhere}
    for name in POOL_LEVEL_ENGINE_FIELDS:
        assert PoolArgs.model_fields[name].default == getattr(EngineConfig(), name), name
    assert set(EngineArgs.model_fields) == set(engine_fields)
    hints = typing.get_type_hints(EngineConfig)
    for name, field in engine_fields.items():
        assert EngineArgs.model_fields[name].default == field.default, name
        assert EngineArgs.model_fields[name].annotation == hints[name], name
    assert EngineArgs().engine_config(30.0, 10.0) == EngineConfig()


def test_the_autoscaling_config_runs_the_planner_with_serves_delays_off():
    args = AppArgs.model_validate(config_args("autoscaling.yaml"))
    for pool, slo in (("prefill", ("slo_s", 1.0)), ("decode", ("slo_s", 0.1))):
        options = args.deployment_options(pool)
        assert "num_replicas" not in options
        config = options["autoscaling_config"]
        assert config["upscale_delay_s"] == config["downscale_delay_s"] == 0.0  # the planner has its own
        assert config["policy"]["policy_function"] == "autoscale.serve:PlannerPolicy"
        kwargs = config["policy"]["policy_kwargs"]
        assert kwargs["pool"] == pool and kwargs[slo[0]] == slo[1]
    # A prefill replica going away outlives a prefill admitted last and then its lease.
    assert args.deployment_options("prefill")["graceful_shutdown_timeout_s"] == args.prefill_timeout_s + args.kv_lease_s


def test_health_checks_are_set_per_pool_and_left_to_serve_otherwise():
    args = AppArgs.parse({"decode": {"health_check_period_s": 1.5, "health_check_timeout_s": 4}})
    options = args.deployment_options("decode")
    assert options["health_check_period_s"] == 1.5 and options["health_check_timeout_s"] == 4.0
    assert "health_check_period_s" not in args.deployment_options("prefill")
    with pytest.raises(ValueError, match="decode.health_check_period_s: Input should be greater than 0"):
        AppArgs.parse({"decode": {"health_check_period_s": 0}})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prefill": {"autoscaling": {"max_replicas": 2}}}, "prefill.autoscaling.slo_ttft_s: Field required"),
        ({"prefill": {"autoscaling": {"slo_ttft_s": 1, "max_replica": 2}}}, "prefill.autoscaling.max_replica"),
        ({"decode": {"autoscaling": {"slo_itl_s": 0.1, "min_replicas": 3, "max_replicas": 2}}},
         "max_replicas \\(2\\) must be >= min_replicas \\(3\\)"),
        ({"decode": {"autoscaling": {"slo_itl_s": 0.1, "decode_step_s": 0.01}}}, "decode_step_per_seq_s together"),
        ({"prefill": {"num_replicas": 2, "autoscaling": {"slo_ttft_s": 1}}}, "num_replicas or autoscaling"),
        ({"prefill": {"autoscaling": {"slo_ttft_s": 1}, "autoscaling_config": {"max_replicas": 2}}},
         "autoscaling .* or autoscaling_config"),
        ({"prefill": {"graceful_shutdown_timeout_s": 10}}, "prefill.graceful_shutdown_timeout_s \\(10.0\\) must be"),
        ({"mode": "colocated", "decode": {"autoscaling": {"slo_itl_s": 0.1}}}, "decode.autoscaling: the SLO planner"),
        ({"max_migrations": 0, "decode": {"autoscaling": {"slo_itl_s": 0.1}}}, "max_migrations >= 1"),
    ],
)
def test_autoscaling_mistakes_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        AppArgs.parse(change)


def test_the_tiered_config_puts_host_and_disk_tiers_under_each_pool():
    args = AppArgs.model_validate(config_args("tiered.yaml"))
    config = args.engine.engine_config(30.0, 10.0)
    assert config.host_kv_cache_bytes > 0 and config.disk_kv_cache_path and config.disk_kv_cache_bytes > 0
    assert config.shared_kv_bucket is None


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"disk_kv_cache_path": "/tmp/x"}, "needs both disk_kv_cache_path and disk_kv_cache_bytes"),
        ({"shared_kv_bucket": "b", "shared_kv_bytes": 1 << 30}, "loads through host memory"),
        ({"host_kv_cache_bytes": 1 << 30, "kv_tier_write_slots": 0}, "kv_tier_write_slots must be >= 1"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
        ({"kv_cache_scales": "/tmp/scales.json"}, "applies to an FP8 KV cache"),
    ],
)
def test_tier_settings_are_checked_naming_the_field(engine, message):
    args = config_args("default.yaml")
    args["engine"] = {**args["engine"], **engine}
    with pytest.raises(ValueError, match=message):
        AppArgs.model_validate(args)


def test_an_fp8_kv_cache_is_an_engine_option_of_the_yaml():
    args = config_args("default.yaml")
    args["engine"] = {**args["engine"], "kv_cache_dtype": "fp8_e4m3"}
    assert AppArgs.model_validate(args).engine_config().kv_cache_dtype == "fp8_e4m3"


def test_tensor_parallel_size_is_per_pool_and_asks_serve_for_one_bundle_per_rank():
    args = AppArgs.model_validate({**config_args("colocated.yaml"), "decode": {
        "ray_actor_options": {"num_cpus": 2, "num_gpus": 1}, "tensor_parallel_size": 4}})
    options = args.deployment_options("decode")
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}] * 4
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert args.engine_config("decode").tensor_parallel_size == 4
    assert "placement_group_bundles" not in AppArgs.model_validate(config_args("colocated.yaml")).deployment_options(
        "decode")
    with pytest.raises(ValueError, match="engine.tensor_parallel_size"):
        AppArgs.model_validate({**config_args("colocated.yaml"), "engine": {"tensor_parallel_size": 2}})
    AppArgs.model_validate({**config_args("default.yaml"), "decode": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match="decode.tensor_parallel_size 2: the torch transfer backend moves whole"):
        AppArgs.model_validate({**config_args("default.yaml"), "transfer_backend": "torch",
                                "decode": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match="KV tiers .* tensor_parallel_size or expert_parallel_size > 1"):
        AppArgs.model_validate({**config_args("colocated.yaml"), "engine": {"host_kv_cache_bytes": 1 << 20},
                                "decode": {"tensor_parallel_size": 2}})


def test_expert_parallel_pools_ask_for_a_bundle_per_rank_and_name_what_they_cannot_run():
    args = AppArgs.model_validate(config_args("gpu_qwen3_30b_a3b_ep.yaml"))
    assert [len(args.deployment_options(pool)["placement_group_bundles"]) for pool in ("prefill", "decode")] == [2, 4]
    decode = args.engine_config("decode")
    assert (decode.expert_parallel_size, decode.tensor_parallel_size, decode.num_redundant_experts) == (4, 4, 8)
    assert args.engine_config("prefill").expert_parallel_size == 2
    replicated = AppArgs.model_validate({**config_args("default.yaml"), "decode": {"expert_parallel_size": 2}})
    assert len(replicated.deployment_options("decode")["placement_group_bundles"]) == 2  # attention whole on each
    with pytest.raises(ValueError, match="decode.expert_parallel_size 2: the torch transfer backend moves whole"):
        AppArgs.model_validate({**config_args("default.yaml"), "transfer_backend": "torch",
                                "decode": {"expert_parallel_size": 2}})
    with pytest.raises(ValueError, match="prefill: expert_parallel_size 2 with tensor_parallel_size 4"):
        AppArgs.model_validate({**config_args("default.yaml"),
                                "prefill": {"expert_parallel_size": 2, "tensor_parallel_size": 4}})
    with pytest.raises(ValueError, match="decode: num_redundant_experts 2 needs expert_parallel_size > 1"):
        AppArgs.model_validate({**config_args("default.yaml"), "decode": {"num_redundant_experts": 2}})


def test_the_70b_config_shards_prefill_over_4_gpus_and_decode_over_2():
    args = AppArgs.model_validate(config_args("gpu_llama3_70b.yaml"))
    assert (args.prefill.tensor_parallel_size, args.decode.tensor_parallel_size) == (4, 2)
    assert args.deployment_options("prefill")["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 4
    gpus = sum(pool.num_replicas * pool.tensor_parallel_size for pool in (args.prefill, args.decode))
    assert gpus == 8 and args.transfer_backend == "nixl"


def test_the_predicted_rule_routes_prefill_by_predicted_latency_with_the_engines_chunk():
    args = {**config_args("default.yaml"), "remote_prefill_predicted": True}
    parsed = AppArgs.parse(args)
    options = parsed.deployment_options("prefill")["request_router_config"]
    assert options.request_router_class == "router.serve:PredictedLatencyRouter"
    assert options.request_router_kwargs["max_num_batched_tokens"] == parsed.engine.max_num_batched_tokens
    assert parsed.remote_prefill_rule().predicted
    decode = parsed.deployment_options("decode")["request_router_config"].request_router_kwargs
    assert decode["max_num_batched_tokens"] == parsed.engine.max_num_batched_tokens
    assert options.request_router_kwargs["num_ingress"] == 1 and "num_ingress" not in decode
    two = AppArgs.parse({**args, "ingress": {"num_replicas": 2}}).deployment_options("prefill")
    assert two["request_router_config"].request_router_kwargs["num_ingress"] == 2  # the guard counts them all


def test_the_predicted_rule_refuses_a_prefill_router_without_a_predictor():
    args = {**config_args("default.yaml"), "remote_prefill_predicted": True}
    args["prefill"]["router"] = {"request_router_class": "router.serve:PrefixAffinityRouter"}
    with pytest.raises(ValueError, match="remote_prefill_predicted needs the predicted-latency prefill router"):
        AppArgs.parse(args)


def test_a_pools_gray_failure_settings_reach_its_router_and_bad_ones_are_refused_by_name():
    args = config_args("default.yaml")
    assert AppArgs.parse(args).deployment_options("prefill")["request_router_config"].request_router_kwargs[
        "gray_failure"] == {}  # the default app's pools have the detector, with its defaults
    args["decode"]["router"] = {"gray_failure": {"window_s": 5.0}}
    del args["prefill"]["router"]
    parsed = AppArgs.parse(args)
    kwargs = parsed.deployment_options("decode")["request_router_config"].request_router_kwargs
    assert kwargs["gray_failure"] == {"window_s": 5.0}
    assert "gray_failure" not in parsed.deployment_options("prefill")["request_router_config"].request_router_kwargs
    for bad, message in (({"window_secs": 5.0}, "window_secs"), ({"slow_factor": 1.2}, "readmit_factor")):
        args["decode"]["router"] = {"gray_failure": bad}
        with pytest.raises(ValueError, match=f"decode.router.gray_failure.*{message}"):
            build_app(args)


def test_the_deepseek_v3_config_splits_the_released_model():
    """gpu_deepseek_v3.yaml's pools split DeepSeek-V3 (the simulator's preset of its released config.json):
    128 heads over 8 ranks with the latent replicated, 256 experts and 8 redundant over 8 ranks."""
    from pd.engine.ep.dispatch import check_ep
    from pd.model.config import model_config_from_dict
    from pd.model.tp import TPShard
    from sim.models import MODELS

    args = AppArgs.model_validate(config_args("gpu_deepseek_v3.yaml"))
    model = model_config_from_dict(MODELS["deepseek-v3"])
    assert model.mla is not None and model.kv_values_per_token == 576 * 61
    for pool in (args.prefill, args.decode):
        local = TPShard(0, pool.tensor_parallel_size).local_config(model, experts=False)
        assert (local.num_heads, local.num_kv_heads) == (16, 1)
        check_ep(model, pool.expert_parallel_size, pool.num_redundant_experts)


def test_prefill_replicas_neither_speculate_nor_load_a_draft():
    spec = {"method": "draft_model", "model": "builtin:tiny-llama", "num_speculative_tokens": 3}
    args = AppArgs.model_validate({**config_args("default.yaml"), "engine": {"speculative_config": spec}})
    assert args.engine_config("decode").speculative_config.model == "builtin:tiny-llama"
    assert args.engine_config("prefill").speculative_config is None  # it stops at the first token


FLOW_CONTROL = {
    "bands": [{"name": "interactive", "max_priority": 0, "ttft_deadline_ms": 2000},
              {"name": "batch", "min_priority": 1}],
    "tenants": {"a": {"weight": 1, "api_keys": ["sk-flow-a"]},
                "b": {"weight": 2, "api_keys": ["sk-flow-b"]},
                "c": {"default_priority": 1, "quota_tokens_per_min": 600000, "max_queued": 128,
                      "api_keys": ["sk-flow-c"]}},
    "default_tenant": "a",
    "saturation": {"max_waiting": 2, "max_kv_usage": 0.9},
}


def _with_flow_control(**changes) -> dict:
    return {**config_args("default.yaml"), "flow_control": {**FLOW_CONTROL, **changes}}


def test_flow_control_is_off_by_default_and_its_settings_become_the_cores():
    from router.flow_config import FlowIdentity, key_digest

    assert AppArgs.parse(config_args("default.yaml")).flow_control is None
    args = AppArgs.parse(_with_flow_control())
    config = args.flow_control.config()
    assert [(band.name, band.min_priority, band.max_priority, band.ttft_deadline_s) for band in config.bands] == [
        ("interactive", None, 0, 2.0), ("batch", 1, None, None)]
    c = config.tenant("c")
    assert (c.weight, c.default_priority, c.quota_tokens_per_min, c.max_queued) == (1.0, 1, 600000, 128)
    assert config.tenant("b").weight == 2.0 and config.key_tenants[key_digest("sk-flow-b")] == "b"
    assert (config.shed_margin, config.max_queued, config.trust_tenant_header) == (0.1, 4096, False)
    assert (config.saturation.max_waiting, config.saturation.max_kv_usage) == (2, 0.9)
    assert config.classify("r", FlowIdentity(api_key="sk-flow-c"), 10, 10, 0.0).band == 1
    assert sorted(args.flow_control.api_keys()) == ["sk-flow-a", "sk-flow-b", "sk-flow-c"]


@pytest.mark.parametrize("changes, message", [
    ({"bandz": []}, "flow_control.bandz: Extra inputs"),
    ({"tenants": {"a": {"wieght": 1}}}, "flow_control.tenants.a.wieght: Extra inputs"),
    ({"bands": []}, "flow_control.bands: List should have at least 1 item"),
    ({"bands": [{"name": "x", "min_priority": 0}, {"name": "y", "max_priority": 5}]}, "overlap or are out of order"),
    ({"bands": [{"name": "x", "min_priority": 3, "max_priority": 1}]}, "min_priority \\(3\\) is above max_priority"),
    ({"bands": [{"name": "x", "ttft_deadline_ms": 0}]}, "flow_control.bands.0.ttft_deadline_ms"),
    ({"tenants": {"a": {"weight": 0}}}, "flow_control.tenants.a.weight: Input should be greater than 0"),
    ({"tenants": {"a": {"quota_tokens_per_min": 0}}}, "flow_control.tenants.a.quota_tokens_per_min"),
    ({"tenants": {"a": {}, "b c": {}}}, "'b c' is not a valid tenant name"),
    ({"default_tenant": "zed"}, "default_tenant 'zed' is not a tenant \\(tenants: a, b, c\\)"),
    ({"tenants": {"a": {"default_priority": 7}}, "bands": [{"name": "only", "max_priority": 0}]},
     "tenant 'a': default_priority 7 is in no band"),
    ({"shed_margin": -1}, "flow_control.shed_margin"),
    ({"queue_reserve": 1}, "flow_control.queue_reserve"),
    ({"saturation": {"max_kv_usage": 2}}, "flow_control.saturation.max_kv_usage"),
])
def test_flow_control_mistakes_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        build_app(_with_flow_control(**changes))


def test_a_key_in_two_tenants_is_refused_naming_both_and_no_key_is_ever_echoed():
    tenants = {"a": {"api_keys": ["sk-shared-secret"]}, "b": {"api_keys": ["sk-other", "sk-shared-secret"]}}
    with pytest.raises(ValueError, match="an API key of tenant 'b' is also one of tenant 'a'") as refused:
        AppArgs.parse(_with_flow_control(tenants=tenants))
    assert "sk-shared-secret" not in str(refused.value)
    for tenants in ({"a": {"api_key": "sk-misspelt-secret"}},  # a misspelt field's value is a key all the same
                    {"a": {"api_keys": "sk-not-a-list-secret"}},
                    {"a": {"api_keys": ["sk-ok", 5]}, "b": {"weight": "heavy", "api_keys": ["sk-beside-secret"]}},
                    {"a": {"api_keys": [""]}}):
        with pytest.raises(ValueError, match="flow_control") as refused:
            AppArgs.parse(_with_flow_control(tenants=tenants))
        assert "secret" not in str(refused.value)
    with pytest.raises(ValueError, match=r"flow_control.tenants.a.weight: .*\(got 0\)"):
        AppArgs.parse(_with_flow_control(tenants={"a": {"weight": 0}}))  # numbers are still echoed


def test_tenants_keys_stay_at_the_ingress():
    args = AppArgs.parse(_with_flow_control())
    pools = args.for_pools()
    assert all(tenant["api_keys"] == [] for tenant in pools["flow_control"]["tenants"].values())
    assert pools["flow_control"]["bands"] == args.flow_control.model_dump()["bands"]
    assert AppArgs.parse(pools).flow_control.config().key_tenants == {}  # the pools' args validate, keyless
    assert "sk-flow" not in repr(args) and "sk-flow" not in repr(args.flow_control.config())
    assert AppArgs.parse(config_args("default.yaml")).for_pools()["flow_control"] is None


def test_an_app_with_flow_control_gives_its_ingress_room_for_the_waiting():
    app = build_app(_with_flow_control())
    ingress = app._bound_deployment
    assert ingress._deployment_config.max_ongoing_requests == 4096 + 256  # max_queued + the default's room
    explicit = {**_with_flow_control(), "ingress": {"max_ongoing_requests": 5000}}
    assert build_app(explicit)._bound_deployment._deployment_config.max_ongoing_requests == 5000
    with pytest.raises(ValueError, match=r"ingress.max_ongoing_requests \(300\) must be above "
                                         r"flow_control.max_queued \(4096\)"):
        build_app({**_with_flow_control(), "ingress": {"max_ongoing_requests": 300}})


def test_a_prefill_calls_deadline_grows_with_its_prompts_steps():
    from pd.config.app import AppArgs

    args = AppArgs.model_validate(config_args("default.yaml"))
    step = args.engine.max_num_batched_tokens
    assert args.prefill_deadline_s(10) == args.prefill_deadline_s(step) == args.prefill_timeout_s
    assert args.prefill_deadline_s(step + 1) == 2 * args.prefill_timeout_s
    assert args.prefill_deadline_s(8191) == 4 * args.prefill_timeout_s  # the default model's max_model_len - 1
