"""KV tiers served: a decode replica killed and replaced finds its disk blocks, and its prompts hit again.

The decode replica holds every prompt it decoded (pulled, then cached and
written through to its disk slot), and the ingress prefills a prompt the
decode pool holds there, so the second pass of the same prompts hits on the
decode replica; after the kill, its successor's hits come from the disk.

Destructive: it kills a replica, so it runs last (see tests/conftest.py), on its own app.
"""

from __future__ import annotations

import pytest

from tests.serve.conftest import Client, config_args, ensure_app, pool_stats, replica_ids, wait_until
from tests.serve.test_faults import _kill

pytestmark = pytest.mark.destructive

MODEL = "builtin:tiny-llama"
# Long enough to be prefilled remotely (the threshold is 256 tokens), each its own document.
PROMPTS = [f"document {k}: " + " ".join(f"w{k}x{i}" for i in range(180)) for k in range(6)]


def _decode() -> dict:
    [stats] = pool_stats("DecodeServer")
    return stats


def _hit_rate(client: Client) -> tuple[float, list[str]]:
    """Serve every prompt once: the decode replica's prefix-hit tokens over its prompt tokens, and the outputs."""
    before = _decode()
    outputs = []
    for prompt in PROMPTS:
        status, body = client.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                        "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        outputs.append(body["choices"][0]["text"])
    after = _decode()
    prompt_tokens = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    return (after["num_prefix_hit_tokens"] - before["num_prefix_hit_tokens"]) / prompt_tokens, outputs


def test_a_replaced_decode_replica_hits_on_the_blocks_its_predecessor_wrote_to_disk(ray_cluster, tmp_path):
    engine = {**config_args("tiered.yaml")["engine"], "kv_cache_bytes": 64 * 1024**2,
              "disk_kv_cache_path": str(tmp_path), "disk_kv_min_free_bytes": 0}
    ensure_app("tiered.yaml", engine=engine)
    client = Client(ray_cluster["url"])
    _, first = _hit_rate(client)
    before, again = _hit_rate(client)  # prefilled on the decode replica, from its device pool
    assert again == first and before > 0.8
    # What the replica wrote through is on disk before the crash (a real one may lose what is in flight).
    wait_until(lambda: (s := _decode())["disk_pending_writes"] == 0 and s["disk_written_blocks"] > 0)
    killed = _kill("DecodeServer")
    wait_until(lambda: replica_ids("pd", "DecodeServer") and replica_ids("pd", "DecodeServer") != [killed],
               timeout=90)
    wait_until(lambda: _decode()["disk_blocks"] > 0, timeout=60)  # the successor took the slot and found them
    after, outputs = _hit_rate(client)
    assert outputs == first  # the same tokens, read back from disk
    assert after >= 0.8 * before, (before, after)
    assert _decode()["disk_read_blocks"] > 0
    print({"warm_restart_hit_rate_before": round(before, 3), "after": round(after, 3)})
