"""``pd.serve.app:build_app``: the application ``serve run`` starts."""

from __future__ import annotations

from typing import Any

from pd.config.app import AppArgs


def build_app(args: dict[str, Any] | None = None):
    """Validate ``args`` (see ``AppArgs``) and bind Ingress, PrefillServer and DecodeServer.

    In colocated mode there is no prefill pool; the decode pool prefills everything.
    """
    from pd.serve.decode_server import DecodeServer
    from pd.serve.ingress import Ingress
    from pd.serve.prefill_server import PrefillServer

    parsed = AppArgs.parse(args)
    pools = parsed.for_pools()
    prefill = None
    if parsed.mode == "disaggregated":
        prefill = PrefillServer.options(**parsed.deployment_options("prefill")).bind(pools)
    decode_prefill = prefill if parsed.transfer_backend == "torch" else None
    decode = DecodeServer.options(**parsed.deployment_options("decode")).bind(pools, decode_prefill)
    ingress_options = parsed.ingress.model_dump()
    if parsed.flow_control is not None:
        ingress_options["max_ongoing_requests"] = parsed.flow_control.ingress_max_ongoing(
            parsed.ingress.max_ongoing_requests, "max_ongoing_requests" in parsed.ingress.model_fields_set)
    return Ingress.options(**ingress_options).bind(parsed.model_dump(), prefill, decode)
