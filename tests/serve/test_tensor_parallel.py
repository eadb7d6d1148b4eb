"""A tensor-parallel replica served by Ray Serve: ranks as actors in its placement group.

The second test kills a rank, so it runs with the destructive ones (last).
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.serve.conftest import ensure_app, pool_stats, wait_until

TP_DECODE = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}, "tensor_parallel_size": 2}
PROMPT = list(range(5, 90))


def _generate(prompt: list[int], max_tokens: int) -> list[int]:
    from ray import serve

    from pd.serve import GenerateRequest

    request = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)
    chunks = serve.get_app_handle("pd").options(stream=True).generate.remote(request)
    return [token for chunk in chunks for token in chunk.token_ids]


def _ranks() -> list[dict]:
    """The decode replica's ranks: process ids and the bytes of weights each holds."""
    [stats] = pool_stats("DecodeServer")
    return stats["tp_ranks"]


def _decode_replicas() -> dict[str, str]:
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    replicas = details["applications"]["pd"]["deployments"]["DecodeServer"]["replicas"]
    return {r["replica_id"]: r["state"] for r in replicas}


def test_a_two_rank_replica_serves_the_colocated_tokens(ray_cluster, offline):
    """Rank 1 runs as an actor in the replica's placement group; the tokens are one engine's."""
    ensure_app("colocated.yaml", decode=TP_DECODE)
    assert _generate(PROMPT, 12) == offline(PROMPT, 12)
    import ray

    [group] = [g for g in ray.util.placement_group_table().values()
               if g["state"] == "CREATED" and g["strategy"] == "STRICT_PACK" and len(g["bundles"]) == 2]
    driver, rank = _ranks()
    assert driver["pid"] != rank["pid"]
    assert abs(rank["weight_bytes"] / driver["weight_bytes"] - 1) < 0.01  # about half the model each


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_pools_of_different_splits_serve_the_colocated_tokens(ray_cluster, offline, prefill_tp, decode_tp):
    """A prompt long enough to prefill remotely: each decode rank pulls its heads from the prefill ranks
    holding them over NIXL, and the tokens are one engine's."""
    def pool(size: int) -> dict:
        return {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}, "tensor_parallel_size": size}

    ensure_app("default.yaml", prefill=pool(prefill_tp), decode=pool(decode_tp))
    [before] = pool_stats("DecodeServer")
    prompt = list(range(5, 305))  # past remote_prefill_threshold (256)
    assert _generate(prompt, 8) == offline(prompt, 8)
    [after] = pool_stats("DecodeServer")
    assert after["num_remote_pulls"] == before["num_remote_pulls"] + 1
    assert after["num_recompute_fallbacks"] == before["num_recompute_fallbacks"]
    assert len(after["tp_ranks"]) == decode_tp and len(pool_stats("PrefillServer")[0]["tp_ranks"]) == prefill_tp


def test_more_ranks_than_the_placement_group_has_bundles_are_refused(ray_cluster):
    import ray
    import torch
    from ray.util.placement_group import placement_group, remove_placement_group

    from pd.serve.tp_launcher import RayLauncher

    group = placement_group([{"CPU": 0.01}])
    ray.get(group.ready(), timeout=30)
    try:
        with pytest.raises(ValueError, match="needs a placement group of 2 bundles, one per rank; this replica's has 1"):
            RayLauncher(group).check(2, torch.device("cpu"))
        with pytest.raises(ValueError, match="need a GPU in every rank's bundle; bundles \\[0\\] have none"):
            RayLauncher(group).check(1, torch.device("cuda"))
        with pytest.raises(ValueError, match="has 0"):
            RayLauncher().check(2, torch.device("cpu"))  # outside any placement group
    finally:
        remove_placement_group(group)


@pytest.mark.destructive
def test_a_dead_rank_takes_its_replica_down_and_serve_replaces_it(ray_cluster, offline):
    """Rank 1's process killed while the replica is idle: its health check fails, Serve starts a new
    replica (and rank), which serves the same tokens; nothing of the old one is left running.

    Checked every second (Serve's default is 10 s, and it replaces a replica after three failed checks).
    """
    ensure_app("colocated.yaml", decode={**TP_DECODE, "health_check_period_s": 1.0})
    [before] = _decode_replicas()
    _, rank = _ranks()
    os.kill(rank["pid"], signal.SIGKILL)
    wait_until(lambda: before not in _decode_replicas() and list(_decode_replicas().values()) == ["RUNNING"],
               timeout=120)
    assert _generate(PROMPT, 12) == offline(PROMPT, 12)
    _, new_rank = _ranks()
    assert new_rank["pid"] != rank["pid"]
