import json
import math
from dataclasses import replace

import pytest

from bench import router as bench_router
from bench.ray_prefix import RAY_BLOCK_CHARS, ray_block_text
from pd.workload.trace import (
    TRACE_BLOCK_TOKENS,
    BurstyTraceConfig,
    LongHistoryTraceConfig,
    MultiTenantTraceConfig,
    SystemPromptTraceConfig,
    TraceRequest,
    dump_trace,
    generate_bursty,
    generate_long_history,
    generate_multi_tenant,
    generate_system_prompt,
    load_trace,
    read_trace,
)
from router.policy import PolicyConfig
from sim.clock import EventLoop
from sim.placement import AffinityPlacement, LatencyPlacement

SMALL_MULTI_TENANT = MultiTenantTraceConfig(num_requests=300, num_tenants=12, rate_per_s=10.0, think_time_s=5.0)
SMALL_SYSTEM_PROMPT = SystemPromptTraceConfig(num_requests=200)


def assert_ids_chain(requests: list[TraceRequest]) -> None:
    """An id stands for its block and everything before it."""
    prefix_of: dict[int, tuple[int, ...]] = {}
    for request in requests:
        assert len(request.hash_ids) == math.ceil(request.input_length / TRACE_BLOCK_TOKENS)
        for position, block_id in enumerate(request.hash_ids):
            assert prefix_of.setdefault(block_id, request.hash_ids[:position]) == request.hash_ids[:position]


def test_jsonl_round_trip_in_arrival_order(tmp_path):
    requests = [TraceRequest(20, 600, 7, (3, 4)), TraceRequest(10, 100, 5, (1,))]
    path = tmp_path / "trace.jsonl"
    dump_trace(requests, path)
    first_line = json.loads(path.read_text().splitlines()[0])
    assert first_line == {"timestamp": 20, "input_length": 600, "output_length": 7, "hash_ids": [3, 4]}
    assert load_trace(path) == [requests[1], requests[0]]
    assert read_trace(path) == requests


def test_read_trace_keeps_fractional_timestamps_and_ignores_other_keys(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 1.5, "input_length": 3, "output_length": 0, "hash_ids": [-2], "x": 1}\n\n')
    assert read_trace(path) == [TraceRequest(1.5, 3, 0, (-2,))]


@pytest.mark.parametrize("line, names", [
    ('{"timestamp": 1}', "`input_length`"),
    ('{"timestamp": "1", "input_length": 3, "output_length": 1, "hash_ids": []}', "`$.timestamp`"),
    ('{"timestamp": 1, "input_length": -3, "output_length": 1, "hash_ids": []}', "`$.input_length`"),
    ('{"timestamp": 1, "input_length": 3, "output_length": 1.5, "hash_ids": []}', "`$.output_length`"),
    ('{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [4, true]}', "`$.hash_ids[1]`"),
    ("[1, 2]", "object"),
    ("{not json", "malformed"),
])
def test_read_trace_names_the_line_and_field_of_a_bad_record(tmp_path, line, names):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n\n' + line + "\n")
    with pytest.raises(ValueError, match="not a Mooncake trace record") as error:
        read_trace(path)
    assert str(error.value).startswith(f"{path}:3: ")
    assert names in str(error.value)


def test_read_trace_rejects_an_empty_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="the trace is empty"):
        read_trace(path)


def test_multi_tenant_trace_shares_contexts_and_extends_conversations():
    requests = generate_multi_tenant(SMALL_MULTI_TENANT)
    assert requests == generate_multi_tenant(SMALL_MULTI_TENANT)
    assert len(requests) == 300
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    assert_ids_chain(requests)
    first_ids = {request.hash_ids[0] for request in requests}
    assert 1 < len(first_ids) <= 12  # one context per tenant
    # Popular tenants get more traffic (Zipf).
    counts = sorted((sum(r.hash_ids[0] == first for r in requests) for first in first_ids), reverse=True)
    assert counts[0] > 3 * counts[-1]
    # Some turns extend an earlier turn's whole prompt (all its full blocks).
    extended = 0
    seen = set()
    for request in requests:
        for earlier_len in range(len(request.hash_ids) - 1, 8, -1):
            if request.hash_ids[:earlier_len] in seen:
                extended += 1
                break
        seen.add(request.hash_ids[: request.input_length // TRACE_BLOCK_TOKENS])
    assert extended > 50


def test_system_prompt_trace_shares_only_the_system_prompt():
    requests = generate_system_prompt(SMALL_SYSTEM_PROMPT)
    assert_ids_chain(requests)
    num_shared = SMALL_SYSTEM_PROMPT.system_prompt_tokens // TRACE_BLOCK_TOKENS
    assert {request.hash_ids[:num_shared] for request in requests} == {tuple(range(num_shared))}
    rest = [block_id for request in requests for block_id in request.hash_ids[num_shared:]]
    assert len(rest) == len(set(rest))


@pytest.mark.parametrize("config", [dict(num_requests=0), dict(rate_per_s=0.0), dict(user_tokens=(10, 5))])
def test_trace_configs_reject_invalid_values(config):
    with pytest.raises(ValueError):
        MultiTenantTraceConfig(**config)
    with pytest.raises(ValueError):
        SystemPromptTraceConfig(**config)


@pytest.mark.parametrize("config", [dict(user_tokens=(10, 5)), dict(output_tokens=(0, 5)), dict(base_rate_per_s=0),
                                    dict(step_start=0.5, step_end=0.4), dict(diurnal_peak=0.5),
                                    dict(system_prompt_tokens=0)])
def test_bursty_config_rejects_invalid_values(config):
    with pytest.raises(ValueError):
        BurstyTraceConfig(**config)


def test_bursty_trace_steps_its_rate_and_shares_the_system_prompt():
    config = BurstyTraceConfig(duration_s=300.0, base_rate_per_s=5.0, diurnal_peak=1.0, step_start=0.5, step_end=1.0)
    requests = generate_bursty(config)
    before = sum(1 for r in requests if r.timestamp_ms < 150_000)
    after = len(requests) - before
    assert 2.5 < after / before < 3.5  # the 3x step, Poisson noise aside
    assert_ids_chain(requests)
    shared = config.system_prompt_tokens // TRACE_BLOCK_TOKENS
    assert {r.hash_ids[:shared] for r in requests} == {tuple(range(shared))}
    assert generate_bursty(config) == requests  # seeded


SMALL_LONG_HISTORY = LongHistoryTraceConfig(num_requests=400, long_share=0.25, num_sessions=3,
                                            max_history_tokens=32768, seed=3)


def test_long_history_trace_is_short_traffic_plus_long_sessions_that_resend_their_history():
    config = SMALL_LONG_HISTORY
    requests = generate_long_history(config)
    assert requests == generate_long_history(config)
    assert requests != generate_long_history(replace(config, seed=4))
    assert len(requests) == 400
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    assert_ids_chain(requests)
    # The short traffic is the multi-tenant trace at the rest of the rate; the long turns take none of its ids.
    short = generate_multi_tenant(replace(config.short, num_requests=300, rate_per_s=7.5, seed=3))
    short_ids = {block_id for r in short for block_id in r.hash_ids}
    long_turns = [r for r in requests if r.hash_ids[0] not in short_ids]
    assert [r for r in requests if r not in long_turns] == short and len(long_turns) == 100
    assert not short_ids & {block_id for r in long_turns for block_id in r.hash_ids}
    # A session's turn extends its previous prompt's full blocks until the history is full; then it starts over.
    last_of_session: dict[int, TraceRequest] = {}
    for turn in long_turns:
        previous = last_of_session.get(turn.hash_ids[0])
        if previous is not None:
            num_full = previous.input_length // TRACE_BLOCK_TOKENS
            assert turn.hash_ids[:num_full] == previous.hash_ids[:num_full]
            assert turn.input_length > previous.input_length + 64  # the answer and the new text
        last_of_session[turn.hash_ids[0]] = turn
    assert 3 <= len(last_of_session) <= 12  # 3 sessions, a few restarts
    assert 20_000 < max(r.input_length for r in long_turns) <= config.max_history_tokens
    assert max(r.input_length for r in short) < 8192


def test_long_history_without_long_share_is_the_short_trace():
    config = replace(SMALL_LONG_HISTORY, long_share=0.0)
    assert generate_long_history(config) == generate_multi_tenant(replace(config.short, num_requests=400, seed=3))


@pytest.mark.parametrize("config", [dict(num_requests=0), dict(long_share=1.0), dict(num_sessions=0),
                                    dict(start_tokens=(0, 5)), dict(max_history_tokens=8192)])
def test_long_history_config_rejects_invalid_values(config):
    with pytest.raises(ValueError):
        LongHistoryTraceConfig(**config)


def test_ray_block_text_is_fixed_length_and_diverges_at_the_first_character():
    texts = [ray_block_text(block_id) for block_id in range(5000)]
    assert {len(text) for text in texts} == {RAY_BLOCK_CHARS}
    assert len({text[0] for text in texts}) == 5000


def replay_all(requests, num_replicas, cache_blocks=256):
    config = bench_router.ReplayConfig(num_replicas=num_replicas, cache_blocks=cache_blocks)
    pd_config = PolicyConfig(block_size=config.block_size)
    # pd is the app's default prefill router, replayed under its own name (latency)
    policies = [policy for policy in bench_router.POLICIES if policy != "pd"]
    return {policy: bench_router.replay(policy, requests, config, pd_config) for policy in policies}


@pytest.mark.slow  # a few hundred requests through every router policy on simulated engines
def test_replay_system_prompt_pins_ray_but_not_ours_and_the_hotspot_queues():
    results = replay_all(generate_system_prompt(SMALL_SYSTEM_PROMPT), num_replicas=4)
    assert results["ray_prefix"].routed_per_replica == [200, 0, 0, 0]
    assert results["ray_prefix"].max_min_load_ratio is None
    assert results["affinity"].max_min_load_ratio <= 1.5
    assert min(results["latency"].routed_per_replica) > 0  # no collapse onto the holder: its queue moves work off
    assert results["latency"].ttft_p99_s < results["ray_prefix"].ttft_p99_s / 2
    assert results["round_robin"].routed_per_replica == [50, 50, 50, 50]
    # The simulated engines queue what one replica gets: its TTFT tail is far behind a balanced pool's.
    assert results["ray_prefix"].ttft_p99_s > 2 * results["round_robin"].ttft_p99_s
    for result in results.values():
        assert sum(result.routed_per_replica) == 200
        assert 0.0 < result.hit_rate < 1.0
        assert 0.0 < result.ttft_p50_s <= result.ttft_p99_s


@pytest.mark.slow  # a few hundred requests through every router policy on simulated engines
def test_replay_multi_tenant_our_routers_beat_round_robin():
    # The tenants' contexts fit in the pool's caches together, not in any one of them.
    results = replay_all(generate_multi_tenant(SMALL_MULTI_TENANT), num_replicas=4, cache_blocks=96)
    for ours in ("latency", "affinity"):
        assert results[ours].hit_rate > results["round_robin"].hit_rate + 0.2
        assert results[ours].ttft_p99_s < results["round_robin"].ttft_p99_s / 2
        assert sum(results[ours].extra["reasons"].values()) == 300
    assert results["affinity"].max_min_load_ratio <= 1.5


def test_pd_names_the_apps_default_prefill_router():
    config = bench_router.ReplayConfig(num_replicas=2)
    pd_config = PolicyConfig(block_size=config.block_size)
    placement = bench_router.make_placement("pd", config, pd_config, EventLoop())
    assert isinstance(placement, LatencyPlacement)
    assert type(bench_router.make_placement("affinity", config, pd_config, EventLoop())) is AffinityPlacement


@pytest.mark.slow  # a few hundred requests through every router policy on simulated engines
def test_replay_with_several_ingress_routers_still_finds_prefixes_and_balances():
    """Each ingress replica's router learns from its own decisions and the shared reports."""
    trace = generate_multi_tenant(SMALL_MULTI_TENANT)
    config = bench_router.ReplayConfig(num_replicas=4, cache_blocks=96, num_ingress=3)
    pd_config = PolicyConfig(block_size=config.block_size)
    round_robin = bench_router.replay("round_robin", trace, config, pd_config)
    for ours in ("pd", "affinity"):
        assert len(bench_router.make_placement(ours, config, pd_config, EventLoop()).policies) == 3
        several = bench_router.replay(ours, trace, config, pd_config)
        assert several.hit_rate > round_robin.hit_rate + 0.2
        assert sum(several.extra["reasons"].values()) == 300
        if ours == "affinity":
            assert several.max_min_load_ratio <= 1.5  # its balance bound


def test_main_prints_one_json_line_per_policy(capsys, tmp_path):
    path = tmp_path / "trace.jsonl"
    dump_trace(generate_system_prompt(SystemPromptTraceConfig(num_requests=50)), path)
    bench_router.main(["--trace", str(path), "--replicas", "2", "--policies", "pd,round_robin"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["policy"] for line in lines] == ["pd", "round_robin"]
    for line in lines:
        assert {"hit_rate", "max_min_load_ratio", "ttft_p50_s", "ttft_p99_s", "utilization", "decide_us_p99"} <= set(line)
