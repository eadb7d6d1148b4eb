"""The ingress: the OpenAI-compatible HTTP API and the handle API, over the two pools.

It owns text: tokenizer, chat template, incremental detokenization and stop
strings. The pools see token ids only.
"""


import hmac
import json
import logging
import os
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from pd.sampling_params import SamplingParams
from pd.serve.args import AppArgs
from pd.serve.body_limit import BodyLimit
from pd.serve.generation import GenerationEvent, PoolClient, RequestFailedError
from pd.serve.handle_api import GenerateChunk, GenerateRequest
from pd.serve.prompts import PromptEncoder
from pd.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    completion_id,
    now,
    usage,
)
from router.shared import RoutingScopes

logger = logging.getLogger(__name__)

app = FastAPI(title="pd: disaggregated prefill/decode serving")
app.add_middleware(BodyLimit, limit=lambda: getattr(app.state, "max_request_body_bytes", None))


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unreadable bodies, unknown routes) in the OpenAI shape."""
    message = exc.detail if isinstance(exc.detail, str) else "invalid request"
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    code = "request_too_large" if exc.status_code == 413 else None
    return JSONResponse(OpenAIError(exc.status_code, message, type=kind, code=code).body(), status_code=exc.status_code)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # A value that fits no member of a union fails once per member: the deepest failure says most.
    first = max(errors, key=lambda error: len(error.get("loc", ())), default={})
    param = _param_name(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
    return JSONResponse(OpenAIError(400, message, param=param).body(), status_code=400)


def _param_name(loc) -> str | None:
    """The request field a pydantic error location names: ``messages.0.content``, never a union member's tag."""
    parts = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if not isinstance(part, int) and not str(part).isidentifier():
            break  # a union member's tag, such as "list[int]" or "function-after[...]"
        parts.append(str(part))
    return ".".join(parts) or None


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    status, message, kind = _classify(exc)
    if status == 500:
        logger.exception("internal error: %r", exc)
    return JSONResponse(OpenAIError(status, message, type=kind).body(), status_code=status)


def _classify(exc: Exception) -> tuple[int, str, str]:
    """HTTP status for failures that are not the client's fault. No stack traces leave."""
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, BackPressureError):
        return 503, "the server is overloaded; retry later", "overloaded_error"
    if isinstance(exc, RequestFailedError):
        return 500, f"this request failed: {exc}", "internal_error"
    return 500, "internal server error", "internal_error"


async def with_deadline(events: AsyncIterator[GenerationEvent], timeout_s: float) -> AsyncIterator[GenerationEvent]:
    """``events`` until ``timeout_s`` has passed; then they are closed (cancelling the pools' work)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise OpenAIError(504, f"request timed out after {timeout_s:g} s", type="timeout_error",
                                  code="request_timeout") from None
            yield event
    finally:
        await events.aclose()


def configured_api_keys(from_config: list[str], from_env: str) -> list[bytes]:
    """Keys from the app config plus the comma-separated environment variable."""
    keys = list(from_config) + [k.strip() for k in from_env.split(",")]
    return [k.encode() for k in keys if k]


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, args: dict, prefill_handle, decode_handle):
        self.args = AppArgs.model_validate(args)
        model_dir = resolve_model_path(self.args.engine.model)
        model_config = load_model_config(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_model_len = self.args.engine.max_model_len or model_config.max_position_embeddings
        eos = model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer and self.tokenizer.eos_token_id is not None else ()
        )
        # Its request routers find this through Serve's replica context (router.shared).
        self.routing_scopes = RoutingScopes()
        self.pools = PoolClient(self.args, prefill_handle, decode_handle, self.tokenizer, eos, self.max_model_len,
                                self.routing_scopes)
        self.prompts = PromptEncoder(self.tokenizer, model_config.vocab_size, self.max_model_len,
                                     self.args.tokenizer_threads, self.args.max_stop_strings, self.args.max_stop_chars)
        self._api_keys = configured_api_keys(self.args.api_keys, os.environ.get(self.args.api_keys_env, ""))
        app.state.max_request_body_bytes = self.args.max_request_body_bytes

    # Input checks shared by every entry point --------------------------------

    def _authorize(self, request: Request) -> None:
        if not self._api_keys:
            return
        header = request.headers.get("authorization", "")
        key = header[7:].encode() if header.lower().startswith("bearer ") else b""
        # Compare against every key, in constant time, so timing reveals nothing.
        matched = False
        for candidate in self._api_keys:
            matched |= hmac.compare_digest(key, candidate)
        if not matched:
            raise OpenAIError(401, "missing or invalid API key", type="authentication_error", code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model != self.args.served_model_name:
            raise OpenAIError(404, f"model {model!r} does not exist; this server has "
                                   f"{self.args.served_model_name!r}", param="model", code="model_not_found")

    def _params(self, body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from None

    # HTTP ---------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return {"object": "list", "data": [
            {"id": self.args.served_model_name, "object": "model", "created": now(), "owned_by": "pd"}
        ]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        token_ids = await self.prompts.encode(body.single_prompt())
        params = self._params(body, body.max_tokens, body.logprobs)
        self.prompts.check_lengths(token_ids, params)
        rid = completion_id("cmpl")
        events = with_deadline(self.pools.generate(rid, token_ids, params, self.prompts.check_stop(body.stop_strings())),
                               self.args.request_timeout_s)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def choice(event: GenerationEvent) -> dict:
            logprobs = None
            if body.logprobs is not None:
                logprobs = {"tokens": [self._token_text(t) for t in event.token_ids],
                            "token_logprobs": event.logprobs, "top_logprobs": None}
            return {"index": 0, "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason}

        def frame(event: GenerationEvent) -> dict:
            return {"id": rid, "object": "text_completion", "created": now(), "model": body.model,
                    "choices": [choice(event)]}

        if body.stream:
            return self._stream(events, frame, include_usage, rid, body.model, "text_completion")
        return await self._collect(events, frame, merge_text=("text",))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        token_ids = await self.prompts.chat(body.chat_messages())
        params = self._params(body, body.max_completion_tokens or body.max_tokens, None)
        self.prompts.check_lengths(token_ids, params)
        rid = completion_id("chatcmpl")
        events = with_deadline(self.pools.generate(rid, token_ids, params, self.prompts.check_stop(body.stop_strings())),
                               self.args.request_timeout_s)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        if body.stream:
            first = [True]

            def chunk(event: GenerationEvent) -> dict:
                delta = {"content": event.text}
                if first[0]:
                    delta["role"] = "assistant"
                    first[0] = False
                return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": body.model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": event.finish_reason}]}

            return self._stream(events, chunk, include_usage, rid, body.model, "chat.completion.chunk")

        def message(event: GenerationEvent) -> dict:
            return {"id": rid, "object": "chat.completion", "created": now(), "model": body.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": event.text},
                                 "finish_reason": event.finish_reason}]}

        return await self._collect(events, message, merge_text=("message", "content"))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""

    async def _collect(self, events: AsyncIterator[GenerationEvent], render, merge_text: tuple[str, ...]) -> dict:
        texts, token_ids, logprobs, last = [], [], [], None
        async for event in events:
            texts.append(event.text)
            token_ids.extend(event.token_ids)
            logprobs.extend(event.logprobs)
            last = event
        merged = GenerationEvent(token_ids, "".join(texts), logprobs, last.finish_reason,
                                 last.num_prompt_tokens, last.num_output_tokens)
        response = render(merged)
        response["usage"] = usage(last.num_prompt_tokens, last.num_output_tokens)
        return response

    def _stream(self, events, render, include_usage: bool, rid: str, model: str, kind: str) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            last = None
            try:
                async for event in events:
                    last = event
                    yield _sse(render(event))
            except OpenAIError as exc:
                yield _sse(exc.body())
                return
            except Exception as exc:  # noqa: BLE001 - the stream must end with an error event, not a hang
                status, message, kind_name = _classify(exc)
                logger.warning("stream %s failed: %r", rid, exc)
                yield _sse(OpenAIError(status, message, type=kind_name).body())
                return
            if include_usage and last is not None:
                yield _sse({"id": rid, "object": kind, "created": now(), "model": model, "choices": [],
                            "usage": usage(last.num_prompt_tokens, last.num_output_tokens)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    # Handle API ---------------------------------------------------------------

    async def process_stats(self) -> dict:
        """This ingress replica's resident memory (for soak tests and operators)."""
        from pd.serve.engine_server import resident_bytes

        return {"rss_bytes": resident_bytes(), "pid": os.getpid(), "num_migrations": self.pools.num_migrations}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream ``GenerateChunk``s for a ``GenerateRequest`` (for other Ray apps)."""
        if request.messages is not None:
            token_ids = await self.prompts.chat(request.messages)
        else:
            token_ids = await self.prompts.encode(request.prompt)
        params = SamplingParams(
            max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, seed=request.seed, ignore_eos=request.ignore_eos,
            logprobs=0 if request.logprobs else None,
        )
        self.prompts.check_lengths(token_ids, params)
        events = self.pools.generate(f"handle-{uuid.uuid4().hex}", token_ids, params, self.prompts.check_stop(request.stop))
        async for event in with_deadline(events, self.args.request_timeout_s):
            yield GenerateChunk(
                token_ids=event.token_ids, text=event.text, logprobs=event.logprobs,
                finish_reason=event.finish_reason,
                usage=usage(event.num_prompt_tokens, event.num_output_tokens) if event.finish_reason else None,
            )
