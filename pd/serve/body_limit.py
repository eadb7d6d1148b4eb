"""A hard bound on request bodies, counted as they arrive.

A body that declares a ``Content-Length`` over the limit is refused with 413
at once (read and dropped up to a cap first, so a client still uploading
gets the answer rather than a reset). A body that declares nothing (chunked)
or too little is counted chunk by chunk, and reading stops at the first byte
past the limit: whatever the client sends, no more than the limit is kept.
"""

from __future__ import annotations

from typing import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A declared oversized body is drained up to this many times the limit before the 413 goes out.
MAX_DRAINED_BODY_FACTOR = 16


def too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"request body is larger than {limit} bytes")


class BodyLimit:
    """ASGI middleware; ``limit()`` is the bound in bytes (None: no bound yet)."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int | None]):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit() if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _drain(receive, MAX_DRAINED_BODY_FACTOR * limit)
            await _send_413(send, limit)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)  # the app answers 413 and reads no further
            return message

        await self.app(scope, counted, send)


async def _drain(receive: Receive, cap: int) -> None:
    drained = 0
    while drained <= cap:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _send_413(send: Send, limit: int) -> None:
    from fastapi.responses import JSONResponse

    from pd.serve.openai_protocol import OpenAIError

    error = OpenAIError(413, too_large(limit).detail, code="request_too_large")
    response = JSONResponse(error.body(), status_code=413)
    await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
