"""Bearer API keys: the ones the app accepts, and a request's check against them in constant time."""

from __future__ import annotations

import hmac
from typing import Mapping

from pd.serve.openai_protocol import OpenAIError


def configured_api_keys(from_config: list[str], from_env: str) -> list[bytes]:
    """Keys from the app config (``api_keys`` and flow control's tenants') plus the comma-separated variable."""
    keys = list(from_config) + [k.strip() for k in from_env.split(",")]
    return [k.encode() for k in keys if k]


def authorize(keys: list[bytes], headers: Mapping[str, str]) -> None:
    """401 unless ``headers`` carry one of ``keys`` as a bearer token (any request passes where none is set)."""
    if not keys:
        return
    header = headers.get("authorization", "")
    key = header[7:].encode() if header.lower().startswith("bearer ") else b""
    # Compare against every key, in constant time, so timing reveals nothing.
    matched = False
    for candidate in keys:
        matched |= hmac.compare_digest(key, candidate)
    if not matched:
        raise OpenAIError(401, "missing or invalid API key", type="authentication_error", code="invalid_api_key")
