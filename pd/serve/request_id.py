"""Every HTTP response names its request: an ``x-request-id`` header, and the same id in an error's body.

Ray Serve's proxy owns the header. It takes the client's ``x-request-id``
(or makes one), passes it to the app in the request's headers, and adds it
to the response. The ingress adopts that id: an error body names it
(``error.request_id``) and ``GET /debug/requests/{id}`` finds the request by
it, as by the completion's own ``id`` (``cmpl-…``, ``chatcmpl-…``). Where no
proxy put one on the request (a test's app, another front), the ingress makes
one (``req-<hex>``) and adds the header itself. Either way it is never the
pools' request id: two clients sending the same one must not collide in an
engine, and the debug ring finds the newer of them.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# An id from the request is adopted when it is printable ASCII of at most this many characters.
MAX_CLIENT_ID_CHARS = 128


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def incoming_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's ``x-request-id`` (the client's, or Serve's proxy's), when one we can echo and index."""
    for name, value in headers:
        if name.lower() == HEADER.encode():
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_CLIENT_ID_CHARS and text.isascii() and text.isprintable():
                return text
            return None
    return None


class RequestIds:
    """ASGI middleware: ``request.state.request_id`` for every request, and the header where no proxy adds it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        adopted = incoming_request_id(scope.get("headers") or [])
        state["request_id"] = adopted or new_request_id()
        state["request_id_from_proxy"] = adopted is not None
        if adopted is not None:  # Serve's proxy adds it to the response: a second one would read "id, id"
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                headers.append((HEADER.encode(), state["request_id"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, named)
