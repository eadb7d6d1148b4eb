"""Every serve config validates; typos fail naming the field."""

from __future__ import annotations

import pytest

from pd.serve.app import build_app
from pd.serve.args import AppArgs
from tests.serve.conftest import CONFIG_DIR, config_args

CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def test_the_documented_configs_exist():
    assert {"default.yaml", "colocated.yaml", "gpu_llama3_8b.yaml", "multinode.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates(name):
    args = AppArgs.model_validate(config_args(name))
    from ray.serve.config import RequestRouterConfig

    for pool in (args.prefill, args.decode):
        options = pool.deployment_options("router.serve:PinnedRequestRouter")
        assert isinstance(options["request_router_config"], RequestRouterConfig)


def test_default_config_is_the_documented_one():
    args = AppArgs.model_validate(config_args("default.yaml"))
    assert args.mode == "disaggregated" and args.transfer_backend == "nixl"
    assert args.engine.model == "builtin:tiny-llama" and args.engine.device == "cpu"
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
