"""The ingress: the OpenAI-compatible HTTP API and the handle API, over the two pools.

It owns text: tokenizer, chat template, incremental detokenization and stop
strings. The pools see token ids only. It keeps the last requests' timelines
(``GET /debug/requests/{id}``; every response names its id in ``x-request-id``).
"""

import asyncio
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve

from pd.config.app import AppArgs
from pd.model.config import load_model_config
from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from pd.sampling_params import SamplingParams, StructuredOutput
from pd.serve.adapters import AdapterControl, AdapterTable
from pd.serve.auth import authorize, configured_api_keys
from pd.serve.body_limit import BodyLimit
from pd.serve.choices import run_choices
from pd.serve.errors import classify, error_body, install_error_handlers, is_cancellation
from pd.serve.flow import FlowTicket, IngressFlow, identity_of
from pd.serve.generation import PoolClient
from pd.serve.handle_api import GenerateChunk, GenerateRequest
from pd.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    OpenAIError,
    UnloadLoraAdapterRequest,
    completion_id,
    now,
    usage,
)
from pd.serve.openai_render import ChatRenderer, ChoiceOutput, CompletionRenderer, json_off_loop, sse_frame
from pd.serve.prompts import PromptEncoder
from pd.serve.protocol import LoraRef
from pd.serve.request_id import RequestIds
from pd.serve.stream import with_deadline
from pd.serve.timeline import RequestRing, Timeline
from pd.serve.tools import tool_call_mode
from pd.serve.tracing import RequestTracer, client_context, tracer_provider
from router.flow_config import FlowIdentity
from router.shared import RoutingScopes

logger = logging.getLogger(__name__)

app = FastAPI(title="pd: disaggregated prefill/decode serving")
app.add_middleware(BodyLimit, limit=lambda: getattr(app.state, "max_request_body_bytes", None))
app.add_middleware(RequestIds)  # outermost: a 413 from BodyLimit is named too
install_error_handlers(app)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class _Call:
    """One HTTP request's identity, as every frame of its response repeats it."""

    rid: str
    model: str
    kind: str  # the response object's "object"
    num_prompt_tokens: int
    generate: bool  # False for echo with max_tokens=0: no completion tokens
    body: Any
    timeline: Timeline
    lora: LoraRef | None = None  # the adapter its ``model`` names

    def frame(self, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": self.kind, "created": now(), "model": self.model, "choices": choices}


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, args: dict, prefill_handle, decode_handle):
        self.args = AppArgs.model_validate(args)
        model_dir = resolve_model_path(self.args.engine.model, self.args.engine.revision)
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
        flow_control = self.args.flow_control
        tenant_keys = flow_control.api_keys() if flow_control is not None else []
        self._api_keys = configured_api_keys(self.args.api_keys + tenant_keys,
                                             os.environ.get(self.args.api_keys_env, ""))
        self.flow = None if flow_control is None else IngressFlow(flow_control.config(), self.args.ingress.num_replicas,
                                                                  self.pools)
        app.state.max_request_body_bytes = self.args.max_request_body_bytes
        self.vocab_size = model_config.vocab_size
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        self.requests = RequestRing(self.args.debug_requests_kept)
        provider = tracer_provider(self.args.otlp_traces_endpoint)
        self.tracer = RequestTracer(provider) if provider is not None else None
        engine = self.args.engine
        self.adapters = AdapterTable(self.args.served_model_name, model_config, engine.max_lora_rank,
                                     engine.enable_lora, engine.lora_modules)
        self.adapter_control = AdapterControl(self.adapters, {"prefill": prefill_handle, "decode": decode_handle})

    # Input checks shared by every entry point --------------------------------

    def _authorize(self, request: Request) -> None:
        authorize(self._api_keys, request.headers)

    def _check_model(self, model: str) -> LoraRef | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a model not served here."""
        return self.adapters.resolve(model)

    def _params(self, body, max_tokens: int | None, logprobs: int | None, structured: StructuredOutput | None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, structured, prompt_logprobs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from None

    # HTTP ---------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return {"object": "list", "data": self.adapters.models(now())}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoraAdapterRequest, request: Request) -> dict:
        """Load (or reload) an adapter on every replica; its ``model`` name serves from then on."""
        self._authorize(request)
        return await self.adapter_control.load(body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoraAdapterRequest, request: Request) -> dict:
        """Unload an adapter: new requests for it get 404, running ones finish on it."""
        self._authorize(request)
        return await self.adapter_control.unload(body.lora_name)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        lora = self._check_model(body.model)
        timeline = self._open(request, "cmpl", "/v1/completions", body.stream)
        prompt = body.single_prompt()
        with timeline.span("tokenize"):
            token_ids = await self.prompts.encode(prompt)
        n, num_runs = self._num_choices(body.n, body.best_of)
        generate = body.max_tokens != 0  # max_tokens=0 (with echo): the prompt's scores alone
        # best_of ranks its runs by their log-probability, asked for or not.
        run_logprobs = body.logprobs if num_runs == n else (body.logprobs or 0)
        structured = await self._check_structured(body.structured_output(), body, timeline)
        params = self._params(body, body.max_tokens if generate else 1, run_logprobs, structured, body.prompt_scores_k())
        self.prompts.check_lengths(token_ids, params)
        stop = self.prompts.check_stop(body.stop_strings())
        echo_text = None
        if body.echo:
            echo_text = prompt if isinstance(prompt, str) else self._decode(token_ids)
        renderer = CompletionRenderer(self._token_text, body.logprobs, token_ids, echo_text, generate,
                                      prompt_logprobs_k=body.prompt_logprobs)
        call = _Call(timeline.request_id, body.model, "text_completion", len(token_ids), generate, body, timeline,
                     lora)
        ticket = await self._admit(request, call, token_ids, params.max_tokens * num_runs,
                                   params.prompt_logprobs is not None)
        events = self._choices(call, token_ids, params, stop, num_runs, ticket)
        if body.stream:
            return self._stream(events, renderer, call)
        return await self._collect(events, renderer, call, n)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._authorize(request)
        lora = self._check_model(body.model)
        timeline = self._open(request, "chatcmpl", "/v1/chat/completions", body.stream)
        tools, tool_constraint = tool_call_mode(body)
        with timeline.span("tokenize"):
            token_ids = await self.prompts.chat(body.chat_messages())
        n, _ = self._num_choices(body.n, None)
        structured = await self._check_structured(tool_constraint or body.structured_output(), body, timeline)
        params = self._params(body, body.max_completion_tokens or body.max_tokens, body.logprobs_k(), structured)
        self.prompts.check_lengths(token_ids, params)
        stop = self.prompts.check_stop(body.stop_strings())
        renderer = ChatRenderer(self._token_text, body.logprobs_k(), tools)
        kind = "chat.completion.chunk" if body.stream else "chat.completion"
        call = _Call(timeline.request_id, body.model, kind, len(token_ids), True, body, timeline, lora)
        ticket = await self._admit(request, call, token_ids, params.max_tokens * n)
        events = self._choices(call, token_ids, params, stop, n, ticket)
        if body.stream:
            return self._stream(events, renderer, call)
        return await self._collect(events, renderer, call, n)

    def _num_choices(self, n: int, best_of: int | None) -> tuple[int, int]:
        """``(choices returned, sequences run)``, within ``max_n``."""
        runs = best_of or n
        if runs > self.args.max_n:
            param = "n" if best_of is None else "best_of"
            raise OpenAIError(400, f"{param}={runs} is more than this server's max_n ({self.args.max_n})", param=param)
        return n, runs

    async def _check_structured(self, constraint: StructuredOutput | None, body,
                                timeline: Timeline) -> StructuredOutput | None:
        """``constraint``, once it compiles; a bad schema or regex is the client's 400, never a replica's error."""
        if constraint is not None:
            try:
                with timeline.span("grammar_compile"):
                    await self.prompts.run(self._compile, constraint)
            except ValueError as exc:
                param = (body.constraint_fields() or ["tools"])[0]
                raise OpenAIError(400, str(exc), param=param) from None
        return constraint

    def _compile(self, constraint: StructuredOutput) -> None:
        """Compile ``constraint`` (on a tokenizer thread); the compiler is made on first use, loading xgrammar."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this model has none")
                from pd.engine.structured import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.pools.eos_token_ids)
        self._grammar_compiler.compile(constraint)

    async def _admit(self, request: Request, call: "_Call", token_ids: list[int], max_output_tokens: int,
                     scores_prompt: bool = False) -> FlowTicket | None:
        """Flow control's admission (``pd.serve.flow``), where the app has it: waits, or raises 400 or 429."""
        if self.flow is None:
            return None
        hints = self.pools.route_hints(call.rid, token_ids, call.lora)
        return await self.flow.admit(call.rid, identity_of(request.headers, call.body.priority), hints,
                                     max_output_tokens, call.timeline, self.args.request_timeout_s, scores_prompt)

    def _choices(self, call: "_Call", token_ids: list[int], params: SamplingParams, stop: list[str], n: int,
                 ticket: FlowTicket | None = None):
        """The choices' events, within the request's deadline; at the admitted level's priority under flow control."""
        priority = ticket.level if ticket is not None else call.body.priority or 0
        call.timeline.set(num_prompt_tokens=len(token_ids), max_tokens=params.max_tokens, n=n,
                          lora=call.lora.name if call.lora is not None else None, priority=priority)
        timeout_s = self.args.request_timeout_s - (ticket.waited_s if ticket is not None else 0.0)
        events = with_deadline(run_choices(self.pools, call.rid, token_ids, params, stop, n, call.timeline, call.lora,
                                           priority), max(0.0, timeout_s))
        return events if ticket is None else ticket.track(events)

    def _open(self, request: Request, kind: str, endpoint: str, stream: bool) -> Timeline:
        """The completion's id (``kind-<hex>``) and its timeline in the ring, found by it and by ``x-request-id``."""
        timeline = self.requests.open(completion_id(kind), getattr(request.state, "request_id", None),
                                      endpoint=endpoint, stream=stream)
        request.state.timeline = timeline
        if self.tracer is not None:  # traced from now, under the client's traceparent if it sent one
            self.tracer.begin(timeline, client_context(request.headers))
        return timeline

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False) if self.tokenizer else ""

    async def _collect(self, events, renderer, call: "_Call", n: int) -> dict:
        outputs: dict[int, ChoiceOutput] = {}
        try:
            async for index, event in events:
                outputs.setdefault(index, ChoiceOutput()).add(event)
        except asyncio.CancelledError:  # the client left; an error ends the timeline in its handler
            call.timeline.finish("cancelled")
            raise
        runs = [outputs[i] for i in sorted(outputs)]
        if len(runs) > n:  # best_of: the n runs the model finds most likely
            runs = sorted(runs, key=lambda out: sum(out.logprobs), reverse=True)[:n]
        completion_tokens = sum(out.num_output_tokens for out in outputs.values()) if call.generate else 0

        def build() -> dict:
            return {**call.frame([renderer.choice(i, out) for i, out in enumerate(runs)]),
                    "usage": usage(call.num_prompt_tokens, completion_tokens, runs[0].num_cached_tokens)}

        # A prompt's scores take a second to render: not on the event loop.
        body = await json_off_loop(build, off_loop=any(out.prompt_logprobs for out in runs))
        call.timeline.finish("ok", num_output_tokens=completion_tokens)
        return Response(body, media_type="application/json")

    def _stream(self, events, renderer, call: "_Call") -> StreamingResponse:
        def build(index: int, event, sent: int, cached: int) -> dict:
            frame = call.frame([renderer.delta(index, event)])
            if call.body.continuous_usage:
                frame["usage"] = usage(call.num_prompt_tokens, sent, cached)
            return frame

        async def body() -> AsyncIterator[str]:
            num_output_tokens: dict[int, int] = {}
            num_cached_tokens = 0
            try:
                async for index, event in events:
                    num_output_tokens[index] = event.num_output_tokens if call.generate else 0
                    num_cached_tokens = event.num_cached_tokens if index == 0 else num_cached_tokens
                    yield await sse_frame(build, index, event, sum(num_output_tokens.values()), num_cached_tokens,
                                          off_loop=event.prompt_logprobs is not None)
                call.timeline.finish("ok", num_output_tokens=sum(num_output_tokens.values()))
            except Exception as exc:  # noqa: BLE001 - the stream must end with an error event, not a hang
                if not isinstance(exc, OpenAIError) and not is_cancellation(exc):
                    logger.warning("stream %s failed: %r", call.rid, exc)
                yield _sse(error_body(classify(exc), call.timeline.attributes.get("x_request_id", call.rid),
                                      call.timeline))
                return
            finally:  # a client that left ends it here (an error or a normal end has ended it already)
                call.timeline.finish("cancelled")
            if call.body.include_usage:
                final = call.frame([])
                final["usage"] = usage(call.num_prompt_tokens, sum(num_output_tokens.values()), num_cached_tokens)
                yield _sse(final)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/debug/requests")
    async def debug_requests(self, request: Request, limit: int = 100) -> dict:
        """The newest requests this ingress replica keeps, newest first: id, status, duration."""
        self._authorize(request)
        return {"object": "list", "kept": len(self.requests), "capacity": self.requests.capacity,
                "data": [timeline.summary() for timeline in self.requests.newest(max(0, min(limit, 1000)))]}

    @app.get("/debug/requests/{request_id}")
    async def debug_request(self, request_id: str, request: Request) -> dict:
        """One request's timeline, by its id (the response's ``x-request-id``) or the client's own id."""
        self._authorize(request)
        timeline = self.requests.get(request_id)
        if timeline is None:
            raise OpenAIError(404, f"request {request_id!r} is not among the last {self.requests.capacity} requests "
                                   "this ingress replica keeps (debug_requests_kept)",
                              param="request_id", code="request_not_found")
        return timeline.as_dict()

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica: the probes stop, and traces still held are sent."""
        await self.pools.probes.close()
        if self.flow is not None:
            self.flow.close()
        if self.tracer is not None:
            self.tracer.shutdown()

    # Handle API ---------------------------------------------------------------

    async def process_stats(self) -> dict:
        """This ingress replica's resident memory, migrations and quarantined replicas (for tests and operators)."""
        from pd.serve.engine_server import resident_bytes

        quarantined = {"prefill": sorted(self.pools.prefill_routing.quarantined),
                       "decode": sorted(self.pools.decode_routing.quarantined)}
        slowness = {"prefill": dict(self.pools.prefill_routing.slowness),
                    "decode": dict(self.pools.decode_routing.slowness)}
        return {"rss_bytes": resident_bytes(), "pid": os.getpid(), "num_migrations": self.pools.num_migrations,
                "quarantined": quarantined, "slowness": slowness,
                "flow": self.flow.stats() if self.flow is not None else None}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream ``GenerateChunk``s for a ``GenerateRequest`` (for other Ray apps)."""
        lora = self.adapters.resolve(request.model) if request.model is not None else None
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
        request_id, ticket = f"handle-{uuid.uuid4().hex}", None
        if self.flow is not None:  # the default tenant, at the request's priority
            ticket = await self.flow.admit(request_id, FlowIdentity(priority=request.priority),
                                           self.pools.route_hints(request_id, token_ids, lora), params.max_tokens,
                                           Timeline(request_id), self.args.request_timeout_s)
        priority = ticket.level if ticket is not None else request.priority or 0
        events = self.pools.generate(request_id, token_ids, params, self.prompts.check_stop(request.stop), lora=lora,
                                     priority=priority)
        timeout_s = self.args.request_timeout_s - (ticket.waited_s if ticket is not None else 0.0)
        events = with_deadline(((0, event) async for event in events), max(0.0, timeout_s))
        async for _, event in events if ticket is None else ticket.track(events):
            yield GenerateChunk(
                token_ids=event.token_ids, text=event.text, logprobs=event.logprobs,
                finish_reason=event.finish_reason,
                usage=usage(event.num_prompt_tokens, event.num_output_tokens) if event.finish_reason else None,
            )
