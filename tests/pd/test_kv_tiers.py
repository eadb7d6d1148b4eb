"""The disk tier and the shared store: written through, found again after the device and host churn, verified, bounded."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from pd import LLM, SamplingParams
from pd.engine.tiers.block_store import check_trailer, namespace_of, pack_trailer, trailer_bytes
from router.tiers import Tier
from tests.pd.tiers_common import CHURN, DEVICE_BLOCKS, FIRST, FIRST_HASHES, HOST_BLOCKS, PARAMS, served


def tiered(block_bytes: int, **kwargs) -> LLM:
    return LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS, host_kv_cache_bytes=HOST_BLOCKS * block_bytes, **kwargs)


def again_after_churn(llm: LLM) -> tuple[list[int], int]:
    """Serve FIRST, churn it out of the device and host, serve it again: its tokens and its prefix-hit tokens."""
    llm.generate([FIRST], PARAMS)
    for prompt in CHURN:
        llm.generate([prompt], PARAMS)
    llm.engine.tiers.flush()
    assert FIRST_HASHES[0] not in llm.engine.tiers.host and not llm.engine.block_pool.is_cached(FIRST_HASHES[0])
    return served(llm)


def records(directory) -> list:
    return [path for path in directory.iterdir() if path.name != ".lock"]


def test_a_prefix_gone_from_device_and_host_hits_on_disk_with_the_same_tokens(tmp_path, block_bytes, reference):
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    tokens, hit = again_after_churn(llm)
    assert tokens == reference
    assert hit == 8 * 16
    stats = llm.engine.stats()
    assert stats.disk_read_blocks >= 8 and stats.disk_written_blocks >= 8 and stats.num_used_blocks == 0
    llm.engine.close()


def test_cache_events_follow_a_block_down_the_tiers(tmp_path, block_bytes):
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    llm.generate([FIRST], PARAMS)
    for prompt in CHURN:
        llm.generate([prompt], PARAMS)
    llm.engine.tiers.flush()
    first = FIRST_HASHES[0]
    _, events = llm.engine.block_pool.events.window()
    seen = [(e.stored, Tier(e.tier)) for e in llm.engine.block_pool.events._events if e.block_hash == first]
    assert seen[:3] == [(True, Tier.DEVICE), (True, Tier.HOST), (True, Tier.DISK)]
    latest = [e for e in events if e.block_hash == first]
    assert [(e.stored, e.tier) for e in latest] == [(True, Tier.DISK)]
    llm.engine.close()


def test_a_restarted_engine_finds_its_disk_blocks_and_announces_them(tmp_path, block_bytes, reference):
    first = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    first.generate([FIRST], PARAMS)
    first.engine.close()  # as a replica that is killed: nothing is read back, the files stay
    restarted = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    _, events = restarted.engine.cache_events()
    announced = {e.block_hash for e in events if e.stored and e.tier == Tier.DISK}
    assert set(FIRST_HASHES[:8]) <= announced
    tokens, hit = served(restarted)
    assert tokens == reference and hit == 8 * 16
    restarted.engine.close()


@pytest.mark.parametrize("damage", ["tokens", "truncated", "deleted"])
def test_a_damaged_record_is_recomputed_never_served(tmp_path, block_bytes, reference, damage, caplog):
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    llm.generate([FIRST], PARAMS)
    for prompt in CHURN:
        llm.generate([prompt], PARAMS)
    llm.engine.tiers.flush()
    store = llm.engine.tiers.disk.records.store
    path = store.path(FIRST_HASHES[3])  # the fourth block of the prompt
    data = bytearray(path.read_bytes())
    if damage == "tokens":
        data[store.data_bytes + 24] ^= 0xFF  # the first token in the trailer
        path.write_bytes(data)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="pd.engine.tiers.store"):
        tokens, hit = served(llm)
    assert tokens == reference
    assert hit == 3 * 16  # the three blocks before it; the rest recomputed
    assert llm.engine.stats().disk_rejected_reads == 1
    assert "rejected" in caplog.text
    llm.engine.close()


def test_a_full_disk_stops_the_tier_with_a_metric_and_a_log_line_and_serving_goes_on(tmp_path, block_bytes,
                                                                                      reference, caplog):
    free = shutil.disk_usage(tmp_path).free
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30,
                 disk_kv_min_free_bytes=free * 2)
    with caplog.at_level(logging.ERROR, logger="pd.engine.tiers.store"):
        [out] = llm.generate([FIRST], PARAMS)
        llm.engine.tiers.flush()
    stats = llm.engine.stats()
    assert out.token_ids == reference
    assert stats.disk_disabled == 1 and stats.disk_written_blocks == 0
    assert "writes stopped" in caplog.text
    assert records(llm.engine.tiers.disk.records.dir) == []  # no partial file left
    llm.engine.close()


def test_the_disk_tier_deletes_its_least_recently_used_blocks_past_its_capacity(tmp_path, block_bytes):
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1)  # room for one block
    store = llm.engine.tiers.disk.records.store
    llm.engine.tiers.disk.capacity_blocks = 12
    for prompt in [FIRST, *CHURN]:
        llm.generate([prompt], PARAMS)
    llm.engine.tiers.flush()
    llm.engine.tiers.disk.flush()  # the deletions queued by the poll above
    files = records(store.dir)
    stats = llm.engine.stats()
    assert len(files) == stats.disk_blocks == 12
    assert stats.disk_deleted_blocks == stats.disk_written_blocks - 12 > 0
    kept = {bytes.fromhex(f.name.removesuffix(".kv")) for f in files}
    assert not kept & set(FIRST_HASHES)  # the oldest went first
    llm.engine.close()


def test_lower_tier_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="needs both disk_kv_cache_path and disk_kv_cache_bytes"):
        LLM("builtin:tiny-llama", num_blocks=8, host_kv_cache_bytes=1 << 20, disk_kv_cache_path=str(tmp_path))
    with pytest.raises(ValueError, match="loads through host memory"):
        LLM("builtin:tiny-llama", num_blocks=8, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="needs both shared_kv_bucket and shared_kv_bytes"):
        LLM("builtin:tiny-llama", num_blocks=8, host_kv_cache_bytes=1 << 20, shared_kv_bytes=1 << 20)


def test_engines_sharing_a_disk_path_take_their_own_slots_and_a_successor_takes_a_free_one(tmp_path, block_bytes):
    kwargs = {"disk_kv_cache_path": str(tmp_path), "disk_kv_cache_bytes": 1 << 30}
    a, b = tiered(block_bytes, **kwargs), tiered(block_bytes, **kwargs)
    assert (a.engine.tiers.disk.records.dir.name, b.engine.tiers.disk.records.dir.name) == ("slot-0", "slot-1")
    a.generate([FIRST], PARAMS)
    a.engine.close()  # or killed: the lock goes with the process
    successor = tiered(block_bytes, **kwargs)
    assert successor.engine.tiers.disk.records.dir.name == "slot-0"
    assert successor.engine.stats().disk_blocks >= 8
    for llm in (b, successor):
        llm.engine.close()


def test_each_configured_tier_reports_its_usage_hits_bytes_and_times(tmp_path, block_bytes):
    from pd.serve.metrics import tier_values

    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    assert tier_values(LLM("builtin:tiny-llama", num_blocks=8).engine.stats()) == {}  # no tiers, no gauges
    again_after_churn(llm)
    values = tier_values(llm.engine.stats())
    assert {tier for _, tier in values} == {"host", "disk"}  # no shared store configured
    assert values[("capacity_blocks", "host")] == HOST_BLOCKS and values[("blocks", "host")] == HOST_BLOCKS
    assert values[("hit_blocks", "disk")] == 8 and values[("read_bytes", "disk")] == 8 * block_bytes
    assert values[("written_blocks", "host")] > 0 and values[("write_seconds", "host")] > 0
    assert values[("read_seconds", "host")] > 0 and values[("read_bytes", "host")] >= 8 * block_bytes
    assert values[("disabled", "disk")] == 0
    llm.engine.close()


def test_blocks_offered_past_the_writes_in_flight_wait_and_are_written_later(tmp_path, block_bytes, reference):
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30, kv_tier_write_slots=1)
    llm.generate([FIRST], PARAMS)  # 8 blocks cached at once, one write in flight at a time
    llm.engine.tiers.flush()
    stats = llm.engine.stats()
    assert stats.disk_written_blocks >= 8 and stats.disk_dropped_writes == 0 and stats.disk_pending_writes == 0
    assert set(FIRST_HASHES[:8]) <= set(llm.engine.tiers.disk.index)
    llm.engine.close()


def churned_out(llm: LLM) -> None:
    """FIRST served, then pushed out of device and host: it is on disk only."""
    llm.generate([FIRST], PARAMS)
    for prompt in CHURN:
        llm.generate([prompt], PARAMS)
    llm.engine.tiers.flush()


def test_a_request_waits_off_the_step_for_its_disk_blocks_and_nothing_stays_pinned(tmp_path, block_bytes, reference):
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    churned_out(llm)
    engine = llm.engine
    engine.add_request("again", FIRST, PARAMS)
    assert not engine.scheduler.waiting and engine.tiers.loads.num_waiting == 1  # held while its reads run
    assert engine.has_unfinished_requests()
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == reference
    stats = engine.stats()
    assert stats.num_prefix_hit_tokens >= 8 * 16 and stats.disk_read_blocks == 8
    assert engine.tiers.host.num_pinned_slots == 0 and stats.num_used_blocks == 0
    engine.close()


def test_a_request_aborted_while_its_blocks_load_leaves_nothing_held(tmp_path, block_bytes):
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    churned_out(llm)
    engine = llm.engine
    engine.add_request("gone", FIRST, PARAMS)
    aborted = engine.abort_request("gone")
    assert aborted is not None and aborted.finish_reason.name == "ABORT"
    engine.tiers.disk.wait_reads()
    engine.poll_transfers()  # its read lands; nothing is handed to the scheduler
    assert not engine.has_unfinished_requests() and not engine.scheduler.waiting
    assert engine.tiers.host.num_pinned_slots == 0 and engine.stats().num_used_blocks == 0
    engine.close()


def test_a_request_scoring_its_prompt_loads_nothing_and_pins_nothing(tmp_path, block_bytes):
    """It computes its whole prompt (cached tokens would have no scores): holding it for a load would only pin slots."""
    llm = tiered(block_bytes, disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    churned_out(llm)
    engine = llm.engine
    engine.add_request("scored", FIRST, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert engine.tiers.loads.num_waiting == 0 and len(engine.scheduler.waiting) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.tiers.host.num_pinned_slots == 0 and engine.stats().disk_read_blocks == 0
    engine.close()


def test_fp8_blocks_go_down_the_tiers_at_a_quarter_of_fp32_and_other_scales_never_load_them(tmp_path, block_bytes):
    fp8_bytes = block_bytes // 4  # the built-in model's fp32 pool: one byte an element instead of four
    with LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS, kv_cache_dtype="fp8_e4m3") as alone:
        [expected] = alone.generate([FIRST], PARAMS)
        num_layers = alone.engine.model_config.num_layers
    llm = LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS, host_kv_cache_bytes=HOST_BLOCKS * fp8_bytes,
              kv_cache_dtype="fp8_e4m3", disk_kv_cache_path=str(tmp_path), disk_kv_cache_bytes=1 << 30)
    tokens, hit = again_after_churn(llm)
    assert tokens == expected.token_ids and hit == 8 * 16
    assert llm.engine.tiers.host.cache.dtype == torch.float8_e4m3fn
    [namespace] = [p for p in tmp_path.iterdir() if p.is_dir()]
    sizes = {path.stat().st_size for slot in namespace.iterdir() for path in records(slot)}
    assert sizes == {fp8_bytes + trailer_bytes(16)}  # measured on disk: a quarter of fp32's data bytes
    llm.engine.close()
    # Other scales: the same model, dtype and tokens, but bytes that mean other values; never loaded.
    scales = tmp_path / "scales.json"
    scales.write_text(json.dumps({"k_scale": [2.0] * num_layers, "v_scale": [2.0] * num_layers}))
    other = LLM("builtin:tiny-llama", num_blocks=DEVICE_BLOCKS, host_kv_cache_bytes=HOST_BLOCKS * fp8_bytes,
                kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(scales), disk_kv_cache_path=str(tmp_path),
                disk_kv_cache_bytes=1 << 30)
    _, hit = served(other)
    assert hit == 0 and other.engine.stats().disk_read_blocks == 0
    other.engine.close()


def test_a_record_of_another_layout_is_refused_by_its_trailer():
    trailer = np.zeros(trailer_bytes(16), dtype=np.uint8)
    pack_trailer(trailer, b"12345678", [7] * 16, 4096, namespace_of(b"fp8 scales a"))
    assert check_trailer(trailer.tobytes(), b"12345678", [7] * 16, 4096, namespace_of(b"fp8 scales a")) is None
    why = check_trailer(trailer.tobytes(), b"12345678", [7] * 16, 4096, namespace_of(b"fp8 scales b"))
    assert why == "a record of another KV layout (dtype or FP8 scales)"
