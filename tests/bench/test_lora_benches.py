"""``bench.lora_decode`` and ``bench.lora_load`` on the tiny model: a line per case with the plain engine
measured beside it, base rows giving the plain engine's tokens, and a load measured against the streams."""

from __future__ import annotations

import json

import pytest

from bench import lora_decode, lora_load

pytestmark = pytest.mark.slow  # whole engines, against each other


def test_lora_decode_prints_each_case_against_the_plain_engine(capsys):
    lora_decode.main(["--model", "builtin:tiny-llama", "--batch", "4", "--adapters", "2", "--rank", "8",
                      "--prompt-tokens", "8", "--max-tokens", "6", "--rounds", "1"])
    lines = {line["case"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(lines) == list(lora_decode.CASES)
    assert lines["plain"]["vs_plain"] == 1.0 and all(line["num_steps"] >= 4 for line in lines.values())
    assert lines["base_rows"]["outputs_equal_plain"] is True
    assert {"cpu", "isa", "tok_s", "step_s_p50"} <= set(lines["adapters"])


def test_lora_load_measures_the_streams_around_a_load(capsys):
    lora_load.main(["--model", "builtin:tiny-llama", "--streams", "2", "--max-tokens", "24", "--rank", "4"])
    [line] = map(json.loads, capsys.readouterr().out.splitlines())
    assert line["load_s"] > 0 and line["new_adapter_ttft_s"] > 0 and line["step_s_p50"] > 0
    assert line["max_gap_during_load_s"] > 0
