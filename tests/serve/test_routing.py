"""The prefix-affinity router placing real requests on a Serve app with 2 prefill replicas."""

from __future__ import annotations

from collections import Counter

from pd import SamplingParams
from pd.serve.protocol import PoolControl, PoolRequest, PrefillResult
from router.hashing import hash_block_tokens
from router.protocol import RouteHints
from tests.serve.conftest import ensure_app

BLOCK = 16
PARAMS = SamplingParams(max_tokens=1, temperature=0)


def _prefill(handle, request_id: str, token_ids: list[int], block_size: int = BLOCK) -> str:
    """Prefill through the router; release the lease; return the replica that served it."""
    request = PoolRequest(request_id=request_id, token_ids=tuple(token_ids), sampling=PARAMS)
    hints = RouteHints(request_id=request_id, num_prompt_tokens=len(token_ids),
                       block_hashes=tuple(hash_block_tokens(token_ids, block_size)))
    result = PrefillResult.decode(handle.prefill.remote(hints.encode(), request.encode()).result())
    release_hints = RouteHints(request_id=request_id, target_replica_id=result.replica_id)
    handle.release.remote(release_hints.encode(), PoolControl(request_id=request_id).encode()).result()
    return result.replica_id


def test_shared_prefixes_land_on_their_holder_and_spill_over_when_it_is_busy(ray_cluster):
    from ray import serve

    ensure_app("default.yaml", prefill={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}})
    handle = serve.get_deployment_handle("PrefillServer", "pd")
    prefix_a = list(range(10, 10 + 20 * BLOCK))
    prefix_b = list(range(400, 400 + 20 * BLOCK))

    # Two distinct long prefixes, each followed by a sibling sharing it.
    first_a = _prefill(handle, "a0", prefix_a + [1])
    first_b = _prefill(handle, "b0", prefix_b + [1])
    assert _prefill(handle, "a1", prefix_a + [2, 3]) == first_a
    assert _prefill(handle, "b1", prefix_b + [2, 3]) == first_b

    # One prefix shared by every request must not pin all traffic to one replica.
    placed = Counter(_prefill(handle, f"s{i}", prefix_a + [100 + i]) for i in range(8))
    assert len(placed) == 2 and max(placed.values()) <= 6, placed


def test_the_router_counts_prefix_tokens_in_the_engines_block_size(ray_cluster):
    """With 32-token blocks, a sibling goes to the holder of its 10-block prefix.

    The weights leave only two terms: the prefix (1 per matched token) and this
    router's own recent requests (256 tokens per request beyond the least-sent
    replica's). The holder got one request more, so it wins only if its 320
    matched tokens are counted as 320; counted in 16-token blocks they are 160.
    """
    from ray import serve

    block = 32
    weights = {"w_prefix": 1.0, "request_load_tokens": 0.0, "kv_usage_load_tokens": 0.0,
               "recent_prefill_weight": 0.0, "max_routed_ratio": None}
    ensure_app("default.yaml", engine={"block_size": block, "kv_cache_bytes": 64 * 1024**2},
               prefill={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25},
                        "router": {"request_router_kwargs": weights}})
    handle = serve.get_deployment_handle("PrefillServer", "pd")
    prefix = list(range(10, 10 + 10 * block))
    holder = _prefill(handle, "p0", prefix + [1], block)
    assert _prefill(handle, "p1", prefix + [2, 3], block) == holder
