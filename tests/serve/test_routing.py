"""The prefix-affinity router placing real requests on a Serve app with 2 prefill replicas."""

from __future__ import annotations

from collections import Counter

from pd import SamplingParams
from pd.serve.messages import PoolControl, PoolRequest, PrefillResult
from router.hashing import hash_block_tokens
from tests.serve.conftest import ensure_app

BLOCK = 16
PARAMS = SamplingParams(max_tokens=1, temperature=0)


def _prefill(handle, request_id: str, token_ids: list[int]) -> str:
    """Prefill through the router; release the lease; return the replica that served it."""
    request = PoolRequest(request_id=request_id, token_ids=token_ids, sampling=PARAMS,
                          block_hashes=hash_block_tokens(token_ids, BLOCK))
    result = PrefillResult.decode(handle.prefill.remote(request.encode()).result())
    handle.release.remote(PoolControl(request_id=request_id, target_replica_id=result.replica_id).encode()).result()
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
