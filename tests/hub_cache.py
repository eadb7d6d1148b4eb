"""A local Hugging Face hub cache, laid out as ``huggingface_hub`` writes it, for tests that run offline.

    $HF_HOME/hub/models--{org}--{name}/
        refs/{branch}              the commit hash the branch points at
        snapshots/{commit}/...     the repository's files at that commit
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def add_snapshot(hf_home: Path, repo_id: str, files_from: Path, branch: str | None = "main") -> str:
    """Copy the files of ``files_from`` in as a commit of ``repo_id`` (on ``branch``); returns the commit hash."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    digest = hashlib.sha1()
    for path in sorted(files_from.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    commit = digest.hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in files_from.iterdir():
        shutil.copy(path, snapshot / path.name)
    if branch is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return commit
