import json

import pytest

from bench import router_matrix
from bench.router import PolicyResult
from pd.workload.trace import TraceRequest


def result(policy: str, ttft_p99_s: float, hit_rate: float, routed: list[int]) -> PolicyResult:
    ratio = max(routed) / min(routed) if min(routed) else None
    return PolicyResult(policy, hit_rate, ratio, ttft_p99_s / 4, ttft_p99_s, 0.5, 10.0, 20.0, routed, {})


def test_goal_checks_compare_the_candidate_with_the_best_other_policy_in_each_seed():
    runs = [
        router_matrix.SeedRun(0, 1.5, 0.5, {"new": result("new", 1.0, 0.72, [3, 2]),
                                            "a": result("a", 2.0, 0.8, [1, 1]), "b": result("b", 1.25, 0.4, [2, 0])}),
        router_matrix.SeedRun(1, 1.5, 0.5, {"new": result("new", 3.0, 0.9, [4, 0]),
                                            "a": result("a", 2.0, 0.9, [1, 1]), "b": result("b", 4.0, 0.3, [1, 1])}),
    ]
    checks = router_matrix.goal_checks("t", "new", runs, num_replicas=2, load=0.75)
    assert checks["against_best_of"] == ["a", "b"] and checks["load"] == 0.75
    goals = checks["goals"]
    assert goals["ttft_p99_ratio"]["per_seed"] == [0.8, 1.5]  # against b's 1.25, then a's 2.0
    assert goals["ttft_p99_ratio"]["median"] == 1.15 and not goals["ttft_p99_ratio"]["met"]
    assert goals["ttft_p99_ratio"]["seeds_met"] == 1
    assert goals["ttft_p50_ratio"]["per_seed"] == [0.8, 1.5]  # each p50 is its p99 / 4
    assert goals["hit_rate_ratio"]["per_seed"] == [0.9, 1.0]  # against a's hit rates
    assert goals["hit_rate_ratio"]["median"] == 0.95 and not goals["hit_rate_ratio"]["met"]
    assert goals["hit_rate_ratio"]["seeds_met"] == 1
    assert "ttft_p99_over_p50" not in goals and not checks["all_met"]
    # Of the seed-medians: new's 2.0 over the best other median, a's 2.0 (b's is 2.625).
    assert goals["ttft_p99_ratio"]["of_medians"] == 1.0 and goals["ttft_p99_ratio"]["met_of_medians"]
    assert goals["hit_rate_ratio"]["of_medians"] == round(0.81 / 0.85, 4)
    # On the shared-system-prompt trace, no collapse: the candidate's p99 within 2x its p50 (4x here).
    collapse = router_matrix.goal_checks("system_prompt", "new", runs, num_replicas=2)["goals"]["ttft_p99_over_p50"]
    assert collapse["per_seed"] == [4.0, 4.0] and not collapse["met"]
    summary = router_matrix.policy_summary("t", "b", runs)
    assert summary["ttft_p99_s"] == {"median": 2.625, "min": 1.25, "max": 4.0}
    assert summary["max_min_load_ratio"] == {"median": None, "min": 1.0, "max": None}


def test_cacheable_hit_rate_counts_full_blocks_sent_before():
    first = TraceRequest(0, 1024, 1, (0, 1))
    again = TraceRequest(1, 1500, 1, (0, 1, 2))  # two of its blocks were sent; its partial third never counts
    assert router_matrix.cacheable_hit_rate([first, again]) == 1024 / 2524


def test_main_prints_summaries_goals_and_the_machine(capsys):
    router_matrix.main(["--traces", "multi_tenant", "--seeds", "2", "--policies", "pd,round_robin",
                        "--candidate", "pd", "--requests", "40", "--replicas", "2", "--loads", "0.5,0.9"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert set(lines[0]["machine"]["isa"]) <= {"avx2", "avx512f"} and lines[0]["machine"]["cpu"]
    summaries, goals, wall = lines[1:3], lines[3], lines[7]
    assert [(line["trace"], line["load"], line["policy"]) for line in summaries] == [
        ("multi_tenant", 0.5, "pd"), ("multi_tenant", 0.5, "round_robin")]
    # The pilot's time scales: linear in the load.
    assert lines[4]["load"] == 0.9 and lines[4]["time_scale"] == pytest.approx(1.8 * summaries[0]["time_scale"],
                                                                                 abs=2e-3)
    for line in summaries:
        assert line["seeds"] == [0, 1]
        for name in router_matrix.METRICS:
            assert line[name]["min"] <= line[name]["median"] <= line[name]["max"]
        assert 0 < line["hit_rate"]["median"] < 1
    # Round-robin deals 40 requests evenly to 2 replicas in every seed.
    assert summaries[1]["max_min_load_ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert goals["candidate"] == "pd" and goals["against_best_of"] == ["round_robin"]
    assert len(goals["goals"]["ttft_p99_ratio"]["per_seed"]) == 2
    assert wall["wall_s"] > 0


def test_unknown_trace_or_policy_is_refused():
    with pytest.raises(SystemExit):
        router_matrix.parse_args(["--traces", "nope"])
    with pytest.raises(SystemExit):
        router_matrix.parse_args(["--policies", "pd,nope"])
    with pytest.raises(SystemExit):
        router_matrix.parse_args(["--loads", "0"])
