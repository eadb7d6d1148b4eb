"""``bench.spec_decode``: its lines at tiny sizes, and the outputs of speculation equal plain decoding's."""

from __future__ import annotations

import json

import pytest

from bench import spec_decode
from bench.spec_workloads import WORKLOADS

FIELDS = {"tok_s", "itl_p50_s", "baseline_tok_s", "baseline_itl_p50_s", "speedup_tok_s", "speedup_p50", "itl_ratio",
          "tpot_s", "acceptance_rate", "mean_accepted", "tokens_per_step", "outputs_equal", "unequal", "cpu", "cpu_flags",
          "isa", "threads", "host_load"}


def _lines(capsys, argv: list[str]) -> list[dict]:
    spec_decode.main(argv)
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def test_every_workload_has_its_prompts_as_chat_conversations():
    sizes = {name: len(make()) for name, make in WORKLOADS.items()}
    assert sizes == {"grounded": 16, "repeat": 50, "free": 16}
    for make in WORKLOADS.values():
        for conversation in make():
            assert conversation[-1]["role"] == "user" and conversation[-1]["content"]
    records = [c[0]["content"] for c in WORKLOADS["repeat"]()]
    assert len(set(records)) == len(records)  # one form, no two records alike


@pytest.mark.slow  # twelve engines built and run in process: 4 s on 2 cores
def test_a_line_per_workload_batch_and_method_with_the_plain_engines_outputs(capsys):
    lines = _lines(capsys, ["--model", "builtin:tiny-llama", "--workload", "free,repeat", "--batch", "1,2",
                            "--num-prompts", "2", "--max-tokens", "12", "--threads", "1", "--no-backoff"])
    assert [(r["workload"], r["batch"], r["method"]) for r in lines] == [
        (w, b, m) for w in ("free", "repeat") for b in (1, 2) for m in ("ngram", "suffix")]
    for record in lines:
        assert FIELDS <= set(record)
        assert record["outputs_equal"] == record["num_prompts"] == 2 and record["unequal"] == []
        assert record["output_tokens"] == record["baseline_output_tokens"] == 2 * 12  # random weights: no EOS
        assert record["tok_s"] > 0 and record["baseline_tok_s"] > 0 and record["itl_p50_s"] > 0
        assert record["speedup_tok_s"] == pytest.approx(record["tok_s"] / record["baseline_tok_s"], rel=0.01)
        assert record["tokens_per_step"] >= 1.0 and record["threads"] == 1


@pytest.mark.slow  # a benchmark's own run on the trained model: two engines, a prompt of 500 tokens
def test_drafts_copied_from_a_grounded_prompt_are_accepted_and_outputs_are_unchanged(capsys):
    (ngram,) = _lines(capsys, ["--workload", "grounded", "--num-prompts", "1", "--max-tokens", "24",
                               "--method", "ngram", "--no-backoff"])
    assert ngram["outputs_equal"] == 1 and ngram["unequal"] == []
    assert ngram["spec_num_drafts"] > 0 and 0 < ngram["acceptance_rate"] <= 1
    assert ngram["mean_accepted"] > 1 and ngram["tokens_per_step"] > 1.5  # correcting typos copies the text
