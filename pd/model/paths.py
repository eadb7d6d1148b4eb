"""Where a model argument's checkpoint lives: a built-in model, generated on first use, or a directory."""

from __future__ import annotations

from pathlib import Path

from pd.model.builtin import BUILTIN_MODELS, BUILTIN_PREFIX, ensure_builtin_model


def resolve_model_path(model: str) -> Path:
    """Map a model argument to a checkpoint directory.

    `builtin:<name>` yields the generated checkpoint, created on first use;
    anything else must be an existing directory.
    """
    if model.startswith(BUILTIN_PREFIX):
        name = model.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {model!r}; known: {_known_models()}")
        return ensure_builtin_model(BUILTIN_MODELS[name])
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist (built-in models: {_known_models()})")
    return path


def _known_models() -> str:
    return ", ".join(BUILTIN_PREFIX + name for name in sorted(BUILTIN_MODELS))
