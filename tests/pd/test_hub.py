"""Hub model ids ``org/name`` resolve through ``huggingface_hub`` from a local hub cache, offline.

``huggingface_hub`` reads ``HF_HOME`` and ``HF_HUB_OFFLINE`` when it is imported, as it does in a replica, so
each case runs in a fresh interpreter with them set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd.model.builtin import BUILTIN_MODELS, ensure_builtin_model
from tests.gguf_files import make_hf_model, write_gguf
from tests.hub_cache import add_snapshot

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pd import LLM, SamplingParams
from pd.model.paths import resolve_model_path
results = {}
for model, revision in json.loads(sys.argv[1]):
    try:
        path = resolve_model_path(model, revision)
        [out] = LLM(model, revision=revision, num_blocks=16).generate(
            [list(range(3, 20))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        results[f"{model}@{revision}"] = {"path": str(path), "tokens": out.token_ids}
    except ValueError as exc:
        results[f"{model}@{revision}"] = {"error": str(exc)}
print(json.dumps(results))
"""


def resolve_offline(hf_home: Path, cases: list[tuple[str, str | None]], cache: Path) -> dict:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PD_CACHE_DIR": str(cache)}
    env.pop("HF_HUB_CACHE", None)
    child = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.integration  # a child Python with its own HF_HOME
def test_hub_ids_resolve_offline_at_a_branch_a_tag_or_a_commit_and_a_missing_one_is_named(tmp_path):
    tiny = ensure_builtin_model(BUILTIN_MODELS["tiny-llama"])
    hf_home = tmp_path / "hf"
    main = add_snapshot(hf_home, "acme/tiny", tiny)
    other = tmp_path / "other"
    make_hf_model("llama", other)
    (other / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    tagged = add_snapshot(hf_home, "acme/tiny", other, branch="v2")
    gguf_only = tmp_path / "gguf-only"
    gguf_only.mkdir()
    write_gguf(other, gguf_only / "model-Q8_0.gguf", "Q8_0")
    add_snapshot(hf_home, "acme/tiny-GGUF", gguf_only)

    results = resolve_offline(hf_home, [("acme/tiny", None), ("acme/tiny", "v2"), ("acme/tiny", tagged),
                                        ("acme/tiny-GGUF", None), ("acme/absent", None), ("acme/tiny", "v3")],
                              tmp_path / "cache")
    assert results["acme/tiny@None"]["path"].endswith(f"snapshots/{main}")
    assert results["acme/tiny@v2"]["path"].endswith(f"snapshots/{tagged}")
    assert results[f"acme/tiny@{tagged}"]["tokens"] == results["acme/tiny@v2"]["tokens"]
    assert results["acme/tiny@None"]["tokens"] != results["acme/tiny@v2"]["tokens"]  # another model's weights
    assert "/gguf-model-Q8_0-" in results["acme/tiny-GGUF@None"]["path"]  # converted from the snapshot's GGUF
    assert len(results["acme/tiny-GGUF@None"]["tokens"]) == 4
    for missing in ("acme/absent@None", "acme/tiny@v3"):
        error = results[missing]["error"]
        assert "not in the local hub cache" in error and "HF_HUB_OFFLINE" in error
    assert "at revision 'v3'" in results["acme/tiny@v3"]["error"]


def test_a_revision_for_a_local_model_is_refused(tmp_path):
    from pd.model.paths import resolve_model_path

    with pytest.raises(ValueError, match="revision 'main' is for hub model ids"):
        resolve_model_path(str(tmp_path), "main")
    with pytest.raises(ValueError, match="revision 'main' is for hub model ids"):
        resolve_model_path("builtin:tiny-llama", "main")
