"""A bad app config described for its author, without echoing a secret.

``describe_errors`` writes one line per validation error: where, what, and
the offending value unless the field holds or may hold a secret (an API key,
or anything under a section that holds keys).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

SECRET_FIELDS = ("api_keys",)
# Sections holding secrets below their top (flow_control's tenants' api_keys): only their numbers and booleans are
# echoed, never a string (a key, or a key under a misspelt field) nor a mapping or list that may hold one.
SECRET_SECTIONS = ("flow_control",)


def describe_errors(exc: ValidationError) -> str:
    """One line per error: where, what, and the offending value unless the field holds secrets."""
    lines = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "args"
        line = f"  {where}: {error['msg']}"
        if "input" in error and _echoes(error["loc"], error["input"]):
            line += f" (got {error['input']!r:.200})"
        lines.append(line)
    return "\n".join(lines)


def _echoes(loc: tuple, value: Any) -> bool:
    # A model-wide error's input is the whole args, secrets included: never echoed.
    if not loc or any(part in SECRET_FIELDS for part in loc):
        return False
    return loc[0] not in SECRET_SECTIONS or value is None or isinstance(value, (bool, int, float))
