"""``bench.dense_rows``: one step's layers in the model's shapes, both forms timed, against the copy bandwidth."""

from __future__ import annotations

import json

import pytest

from bench import dense_rows
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path


def test_the_step_has_the_models_layers_and_the_lm_head():
    config = load_model_config(resolve_model_path("builtin:tiny-llama"))
    shapes = dense_rows.step_shapes("builtin:tiny-llama")
    assert len(shapes) == 4 * config.num_layers + 1
    assert shapes[2] == (2 * config.intermediate_size, config.hidden_size)
    assert shapes[-1] == (config.vocab_size, config.hidden_size)


@pytest.mark.slow  # the benchmark itself, timed over a step's real weight shapes
def test_each_row_count_reports_both_forms_and_the_copy_bandwidth(capsys):
    dense_rows.main(["--threads", "1", "--rows", "1,3", "--repeats", "2"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["rows"] for line in lines] == [1, 3]
    for line in lines:
        assert line["ours_ms"] > 0 and line["onednn_ms"] > 0 and line["copy_gb_s"] > 0
        assert line["weight_mib"] > 20  # past the caches of a small host, as a decode step reads them
        assert line["onednn_over_ours"] > 0 and 0 < line["ours_frac_of_copy"]
