"""The two trace shapes built to break a prefix router: a flash crowd on one tenant, long and short prompts."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.router_traces import FlashCrowdTraceConfig, LongShortTraceConfig, generate_flash_crowd, generate_long_short
from pd.workload.trace import TRACE_BLOCK_TOKENS


def test_a_flash_crowd_is_one_tenants_context_arriving_in_its_window():
    config = FlashCrowdTraceConfig(num_requests=400, crowd_share=0.25, window=(0.5, 0.6), context_tokens=4096)
    trace = generate_flash_crowd(config)
    assert len(trace) == 400 and trace == sorted(trace, key=lambda request: request.timestamp_ms)
    heads = Counter(request.hash_ids[: 4096 // TRACE_BLOCK_TOKENS] for request in trace)
    crowd_head, crowd_size = heads.most_common(1)[0]
    assert crowd_size >= 100  # the crowd, and the background turns that happen to share nothing of it
    crowd = [request for request in trace if request.hash_ids[:8] == crowd_head]
    span_ms = max(request.timestamp_ms for request in trace if request not in crowd)
    assert all(0.5 * span_ms - 1 <= request.timestamp_ms <= 0.6 * span_ms + 1 for request in crowd)
    assert generate_flash_crowd(config) == trace  # seeded


def test_long_short_mixes_100_token_prompts_with_30k_token_rereads_of_a_few_documents():
    trace = generate_long_short(LongShortTraceConfig(num_requests=1000, long_share=0.1, num_documents=4))
    lengths = Counter("short" if request.input_length == 100 else "long" for request in trace)
    assert lengths["short"] + lengths["long"] == 1000 and lengths["long"] == pytest.approx(100, abs=30)
    longs = [request for request in trace if request.input_length != 100]
    assert all(30_032 <= request.input_length <= 30_256 for request in longs)
    documents = Counter(request.hash_ids[:58] for request in longs)
    assert len(documents) == 4  # every long prompt re-reads one of the four documents
    shorts = [request.hash_ids for request in trace if request.input_length == 100]
    assert len(set(shorts)) == len(shorts)  # no short prompt shares a block


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="window"):
        FlashCrowdTraceConfig(window=(0.7, 0.2))
    with pytest.raises(ValueError, match="long_share"):
        LongShortTraceConfig(long_share=1.0)
