import json

from bench import router_lora


def test_main_prints_an_aware_and_a_blind_line_per_policy(capsys):
    router_lora.main(["--requests", "60", "--rate", "20", "--replicas", "2", "--adapters", "4", "--max-loras", "2",
                      "--policies", "pd,decode", "--kv-tokens", "16384"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["policy"], line["routing"]) for line in lines] == [
        ("pd", "aware"), ("pd", "blind"), ("decode", "aware"), ("decode", "blind")]
    for line in lines:
        assert 0 < line["hit_rate"] < 1 and line["adapter_loads"] >= 2
        assert line["ttft_p50_s"] <= line["ttft_p99_s"] and sum(line["routed_per_replica"]) == 60
        assert (line["adapters"], line["replicas"], line["max_loras"]) == (4, 2, 2)
