"""Every HTTP response names its request: an ``x-request-id`` header, and the id in an error's body.

The id is made when the request arrives (``req-<hex>``). An endpoint that
starts a completion replaces it with the completion's own id
(``cmpl-<hex>``, ``chatcmpl-<hex>``), so the header, the body's ``id`` and
``GET /debug/requests/{id}`` agree. A client's own ``x-request-id`` is kept
beside it (the debug ring finds a request by either), never used as the
pools' request id: two clients sending the same one must not collide in an
engine.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# A client's id is kept when it is printable ASCII of at most this many characters.
MAX_CLIENT_ID_CHARS = 128


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's ``x-request-id``, when it is one we can echo and index: else None."""
    for name, value in headers:
        if name.lower() == HEADER.encode():
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_CLIENT_ID_CHARS and text.isascii() and text.isprintable():
                return text
            return None
    return None


class RequestIds:
    """ASGI middleware: puts ``request_id`` (and ``client_request_id``) in ``request.state``, and the header out."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = new_request_id()
        state["client_request_id"] = client_request_id(scope.get("headers") or [])

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                headers.append((HEADER.encode(), state["request_id"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, named)
