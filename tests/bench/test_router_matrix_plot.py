import json

from bench import router_matrix_plot


def test_it_reads_the_matrix_summaries_by_trace_policy_and_load_and_plots_them(tmp_path):
    lines = [{"machine": {}},
             {"load": 0.9, "trace": "t", "policy": "pd", "ttft_p99_s": {"median": 2.0, "min": 1.0, "max": 3.0}},
             {"load": 0.5, "trace": "t", "policy": "pd", "ttft_p99_s": {"median": 1.0, "min": 0.5, "max": 1.5}},
             {"trace": "t", "load": 0.5, "candidate": "pd", "goals": {}}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summaries = router_matrix_plot.read_summaries([path])
    assert [load for load, _ in summaries["t"]["pd"]] == [0.5, 0.9]
    router_matrix_plot.main([str(path), "--out", str(tmp_path / "m.png")])
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
