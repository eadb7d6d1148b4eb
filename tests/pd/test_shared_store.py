"""The shared store on a real S3-compatible server: a prefix one engine computed hits on another, with no transfer between them."""

from __future__ import annotations

import pytest

from pd import LLM
from pd.engine.tiers.block_store import trailer_bytes
from router.tiers import Tier
from tests.pd.tiers_common import CHURN, DEVICE_BLOCKS, FIRST, FIRST_HASHES, HOST_BLOCKS, PARAMS, served
from tests.s3_server import bucket_keys, create_bucket, s3_server

pytestmark = pytest.mark.integration  # an S3 server (moto) in a subprocess

BUCKET = "pd-kv-test"


@pytest.fixture(scope="module")
def endpoint():
    with s3_server() as url:
        create_bucket(url, BUCKET)
        yield url


def shared_engine(endpoint: str, block_bytes: int, shared_blocks: int = 64) -> LLM:
    return LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS, host_kv_cache_bytes=HOST_BLOCKS * block_bytes,
               shared_kv_bucket=BUCKET, shared_kv_endpoint=endpoint, shared_kv_bytes=shared_blocks * (block_bytes + trailer_bytes(16)))


def test_a_prefix_computed_on_one_engine_hits_on_another_through_the_store(endpoint, block_bytes, reference):
    a, b = shared_engine(endpoint, block_bytes), shared_engine(endpoint, block_bytes)
    a.generate([FIRST], PARAMS)
    a.engine.tiers.flush()
    _, events = a.engine.cache_events()
    assert {e.block_hash for e in events if e.stored and e.tier == Tier.SHARED} >= set(FIRST_HASHES[:8])
    tokens, hit = served(b)  # b has no transport: nothing moves between the engines
    assert tokens == reference
    assert hit == 8 * 16
    stats = b.engine.stats()
    assert stats.shared_read_blocks == 8 and stats.num_remote_pulls == 0
    for llm in (a, b):
        llm.engine.tiers.shared.records.delete(FIRST_HASHES)
        llm.engine.close()


def test_a_miss_in_the_store_is_recomputed_and_remembered(endpoint, block_bytes, reference):
    b = shared_engine(endpoint, block_bytes)
    tier = b.engine.tiers.shared
    assert tier.worth_asking(FIRST_HASHES)
    tier.submit_query(7, FIRST_HASHES)
    tier.wait_reads()
    assert tier.finished() == [("query", 7, 0)]  # the first block, asked alone: missing
    assert not tier.worth_asking(FIRST_HASHES)  # believed for MISS_TTL_S
    tokens, hit = served(b)
    assert tokens == reference and hit == 0
    assert tier.stats.num_store_queries == 1  # the request did not ask again
    b.engine.tiers.flush()
    assert tier.local_run(FIRST_HASHES) == 8  # written since: in its own index, no need to ask
    tier.records.delete(FIRST_HASHES)
    b.engine.close()


def test_the_store_keeps_what_an_engine_wrote_within_its_share_and_nothing_leaks(endpoint, block_bytes):
    llm = shared_engine(endpoint, block_bytes, shared_blocks=5)
    for prompt in [FIRST, *CHURN[:2]]:
        llm.generate([prompt], PARAMS)
    llm.engine.tiers.flush()
    llm.engine.tiers.shared.flush()  # the deletions queued by that poll
    keys = bucket_keys(endpoint, BUCKET)
    assert len(keys) == llm.engine.stats().shared_blocks == 5
    llm.engine.tiers.shared.records.delete([bytes.fromhex(key.rsplit("/", 1)[1]) for key in keys])
    assert bucket_keys(endpoint, BUCKET) == []
    llm.engine.close()


def test_the_store_stays_within_its_total_though_the_engine_that_wrote_it_is_gone(endpoint, block_bytes):
    """A replica that stops leaves its objects; past ``shared_kv_total_bytes`` any replica deletes the oldest."""
    record = block_bytes + trailer_bytes(16)
    gone = shared_engine(endpoint, block_bytes)
    gone.generate([FIRST], PARAMS)
    gone.engine.tiers.flush()
    gone.engine.close()  # its 8 objects stay: nobody owns them now
    assert len(bucket_keys(endpoint, BUCKET)) == 8
    llm = LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS, host_kv_cache_bytes=HOST_BLOCKS * block_bytes,
              shared_kv_bucket=BUCKET, shared_kv_endpoint=endpoint, shared_kv_bytes=12 * record,
              shared_kv_total_bytes=12 * record)
    for prompt in CHURN[:2]:  # 14 blocks more: its own 12 kept, and the 8 left behind past the total
        llm.generate([prompt], PARAMS)
    llm.engine.tiers.flush()  # every write done and applied
    llm.engine.tiers.shared.collect_garbage()  # it also runs as the engine writes: this is the last
    llm.engine.tiers.flush()  # and applies it
    keys = bucket_keys(endpoint, BUCKET)
    assert len(keys) == 12
    assert not {bytes.fromhex(key.rsplit("/", 1)[1]) for key in keys} & set(FIRST_HASHES)  # the oldest went first
    assert llm.engine.stats().shared_collected_blocks >= 8
    from pd.serve.metrics import tier_values

    stats = llm.engine.stats()
    assert tier_values(stats)[("deleted_blocks", "shared")] == stats.shared_deleted_blocks + stats.shared_collected_blocks
    llm.engine.tiers.shared.records.delete([bytes.fromhex(key.rsplit("/", 1)[1]) for key in keys])
    llm.engine.close()
    with pytest.raises(ValueError, match="shared_kv_total_bytes"):
        LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS, host_kv_cache_bytes=HOST_BLOCKS * block_bytes,
            shared_kv_bucket=BUCKET, shared_kv_endpoint=endpoint, shared_kv_bytes=12 * record,
            shared_kv_total_bytes=8 * record)
