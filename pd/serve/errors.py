"""The ingress's errors: every failure answers in the OpenAI shape, naming the request it ended.

An error's body carries ``request_id`` (as the ``x-request-id`` header does,
``pd.serve.request_id``), and the request's timeline, when it has one, ends
with the error (``pd.serve.timeline``). No stack trace leaves the server.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pd.serve.generation import RequestFailedError
from pd.serve.openai_protocol import OpenAIError
from pd.serve.request_id import HEADER
from pd.serve.timeline import Timeline

logger = logging.getLogger(__name__)

# nginx's "client closed request": a call Serve cancelled because the client left. Nobody reads the answer;
# the status keeps it out of the 5xx counts and the logs.
CLIENT_CLOSED = 499


def error_body(error: OpenAIError, request_id: str | None, timeline: Timeline | None) -> dict:
    """``error``'s body naming ``request_id``; ``timeline`` (if any) ends with it."""
    body = error.body()
    if request_id is not None:
        body["error"]["request_id"] = request_id
    if timeline is not None:
        status = {504: "timeout", 429: "shed", CLIENT_CLOSED: "cancelled"}.get(error.status, "error")
        timeline.finish(status, http_status=error.status, error=error.message)
    return body


def error_response(request: Request, error: OpenAIError) -> JSONResponse:
    state = request.state
    body = error_body(error, getattr(state, "request_id", None), getattr(state, "timeline", None))
    request_id = body["error"].get("request_id")
    # A 500 is answered outside the middleware that names every other response: named here, unless the
    # proxy in front names it (pd.serve.request_id).
    own = request_id is not None and not getattr(state, "request_id_from_proxy", False)
    headers = {**({HEADER: request_id} if own else {}), **(error.headers or {})}
    return JSONResponse(body, status_code=error.status, headers=headers or None)


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is a call cancelled under the request: Serve cancels a request's calls when its client
    leaves, and the ingress may see that as the callee's cancellation before its own task is cancelled."""
    from ray.exceptions import TaskCancelledError  # RequestCancelledError is one

    return isinstance(exc, TaskCancelledError)


def classify(exc: Exception) -> OpenAIError:
    """The OpenAI error for a failure that is not the client's fault, or for a client that left."""
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, OpenAIError):
        return exc
    if is_cancellation(exc):
        return OpenAIError(CLIENT_CLOSED, "the request was cancelled", type="cancelled")
    if isinstance(exc, BackPressureError):
        return OpenAIError(503, "the server is overloaded; retry later", type="overloaded_error")
    if isinstance(exc, RequestFailedError):
        if exc.invalid:
            return OpenAIError(400, str(exc), type="invalid_request_error")
        return OpenAIError(500, f"this request failed: {exc}", type="internal_error")
    return OpenAIError(500, "internal server error", type="internal_error")


def _param_name(loc) -> str | None:
    """The request field a pydantic error location names: ``messages.0.content``, never a union member's tag."""
    parts = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if not isinstance(part, int) and not str(part).isidentifier():
            break  # a union member's tag, such as "list[int]" or "function-after[...]"
        parts.append(str(part))
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (unreadable bodies, unknown routes) in the OpenAI shape."""
        message = exc.detail if isinstance(exc.detail, str) else "invalid request"
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(request, OpenAIError(exc.status_code, message, type=kind, code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # A value that fits no member of a union fails once per member: the deepest failure says most.
        first = max(errors, key=lambda error: len(error.get("loc", ())), default={})
        param = _param_name(first.get("loc", ()))
        if first.get("type", "") == "extra_forbidden":
            message = f"unknown field {param!r}"
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return error_response(request, OpenAIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        error = classify(exc)
        if error.status == 500:
            logger.exception("internal error: %r", exc)
        return error_response(request, error)
