"""Where a model argument's checkpoint lives.

A model argument is one of:

- ``builtin:<name>``: a built-in model (``pd.model.builtin``): generated on first use, or a trained one
  shipped as a GGUF file in an installed package;
- a checkpoint directory (``config.json`` and safetensors);
- a ``.gguf`` file, or a directory holding one: converted once into a checkpoint directory in the cache
  (``pd.model.gguf``);
- a hub id ``org/name``: the snapshot ``huggingface_hub`` resolves, as vLLM does. It honours ``HF_HOME``,
  ``HF_HUB_OFFLINE`` and a ``revision``; the snapshot may itself be a checkpoint or hold one GGUF file.
"""

from __future__ import annotations

import re
from pathlib import Path

from pd.model.builtin import BUILTIN_MODELS, BUILTIN_PREFIX, PACKAGED_MODELS, cache_dir, ensure_builtin_model
from pd.model.gguf import find_gguf, gguf_checkpoint

# A hub repository id: one "/" between two names of letters, digits, "-", "_" and ".".
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """Map a model argument to a checkpoint directory (see the module doc).

    ``revision`` (a branch, tag or commit) is for hub ids only.
    """
    if model.startswith(BUILTIN_PREFIX):
        if revision is not None:
            raise ValueError(f"revision {revision!r} is for hub model ids; {model!r} is a built-in model")
        name = model.removeprefix(BUILTIN_PREFIX)
        if name in PACKAGED_MODELS:
            return gguf_checkpoint(PACKAGED_MODELS[name].gguf_path(), cache_dir())
        if name not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {model!r}; known: {_known_models()}")
        return _checkpoint_dir(ensure_builtin_model(BUILTIN_MODELS[name]))
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision {revision!r} is for hub model ids; {model!r} is a local path")
        return _checkpoint_dir(path)
    if HUB_ID.match(model):
        return _checkpoint_dir(_hub_snapshot(model, revision))
    raise ValueError(f"model {model!r} does not exist: it is neither a local directory or .gguf file nor a hub id "
                     f"'org/name' (built-in models: {_known_models()})")


def _checkpoint_dir(path: Path) -> Path:
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_checkpoint(gguf_file, cache_dir())
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist (built-in models: {_known_models()})")
    return path


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """The local snapshot of ``repo_id`` at ``revision``: from the cache, or downloaded unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # The weights in safetensors or GGUF, and the files a checkpoint directory is read by.
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.gguf", "*.jinja", "*.txt"]))
    except LocalEntryNotFoundError as exc:
        raise ValueError(f"model {repo_id!r} is no local path, and as a hub id{_at(revision)} it is not in the local "
                         f"hub cache and cannot be downloaded (HF_HUB_OFFLINE is set, or the hub is out of reach): "
                         f"{exc}") from exc
    except HFValidationError as exc:
        raise ValueError(f"{repo_id!r} is not a valid hub model id: {exc}") from exc
    except OSError as exc:  # RepositoryNotFoundError, RevisionNotFoundError and HTTP errors are OSErrors
        raise ValueError(f"hub model {repo_id!r}{_at(revision)} could not be resolved: {exc}") from exc


def _at(revision: str | None) -> str:
    return "" if revision is None else f" at revision {revision!r}"


def _known_models() -> str:
    return ", ".join(BUILTIN_PREFIX + name for name in sorted([*BUILTIN_MODELS, *PACKAGED_MODELS]))
