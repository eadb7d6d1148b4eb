"""One OpenAI-API request, timed token by token, and judged on its content.

A streamed response is a success only if it is HTTP 200, carries at least one
choice chunk, holds no error chunk and ends with ``data: [DONE]``. Each chunk
that carries a choice counts as a token arrival: the first gives TTFT, the
gaps between the rest are the inter-token latencies. (A server may pack more
than one token into a chunk; the output token count comes from the final
usage chunk, which is asked for with ``stream_options.include_usage``.)
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import requests

# The routes are read as ``client.CHAT_PATH`` by the load test's callers.
from pd.workload.workloads import CHAT_PATH, COMPLETIONS_PATH, LoadRequest  # noqa: F401


@dataclass(frozen=True)
class RequestOptions:
    model: str
    stream: bool = True
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float | None = None  # None: the server's default


@dataclass
class StreamResult:
    """Timings in seconds (``perf_counter`` deltas); ``error`` is None on success."""

    start_time: float  # unix seconds
    ttft_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = math.nan
    num_chunks: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    status_code: int | None = None  # the HTTP status, once it came
    error_code: str | None = None  # an error body's ``code`` (a 429's names why it was shed)
    retry_after_s: float | None = None  # a 429's or 503's Retry-After
    request_id: str | None = None  # the server's x-request-id
    text_parts: list[str] = field(default_factory=list)  # the answer's pieces as they streamed (choice 0)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2 or math.isnan(self.ttft_s):
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(request: LoadRequest, chat: bool, options: RequestOptions) -> dict:
    body: dict = {"model": options.model, "max_tokens": request.max_tokens, "stream": options.stream}
    if chat:
        body["messages"] = request.chat_messages()
    else:
        body["prompt"] = request.completion_prompt()
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.ignore_eos:
        body["ignore_eos"] = True  # an extension (vLLM's): outputs run to max_tokens
    return body


def headers(options: RequestOptions) -> dict[str, str]:
    return {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}


def send(session: requests.Session, base_url: str, path: str, body: dict, options: RequestOptions,
         result: StreamResult | None = None) -> StreamResult:
    """Send one request and time it. Never raises for server or network faults; they land in ``error``.

    ``result`` fills in as chunks arrive, so a caller interrupted mid-stream
    (the run ended) still holds the TTFT and gaps so far.
    """
    result = result if result is not None else StreamResult(start_time=time.time())
    start = time.perf_counter()
    try:
        with session.post(base_url.rstrip("/") + path, json=body, headers=headers(options),
                          stream=body.get("stream", False), timeout=(10.0, options.timeout_s)) as response:
            result.status_code = response.status_code
            result.request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {_error_message(response.text)}"
                result.error_code = _error_code(response.text)
                retry = response.headers.get("retry-after")
                result.retry_after_s = float(retry) if retry and retry.isdigit() else None
            elif body.get("stream"):
                _read_stream(response, start, result)
            else:
                _read_whole(response, start, result)
    except requests.RequestException as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    return result


def _read_stream(response: requests.Response, start: float, result: StreamResult) -> None:
    last = start
    done = False
    # chunk_size bounds one read; chunked transfer encoding still hands over each chunk as it lands.
    for line in response.iter_lines(chunk_size=1024):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            result.error = f"malformed chunk: {data[:80]!r}"
            return
        if "error" in event:
            result.error = f"error chunk: {_message(event['error'])}"
            return
        if event.get("choices"):
            now = time.perf_counter()
            if result.num_chunks == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.num_chunks += 1
            result.text_parts.append(_piece(event["choices"][0]))
        if event.get("usage"):
            result.prompt_tokens = int(event["usage"].get("prompt_tokens", 0))
            result.output_tokens = int(event["usage"].get("completion_tokens", 0))
    result.output_tokens = result.output_tokens or result.num_chunks
    if result.num_chunks == 0:
        result.error = "empty stream"
    elif not done:
        result.error = "stream ended without [DONE]"


def _read_whole(response: requests.Response, start: float, result: StreamResult) -> None:
    try:
        payload = response.json()
    except ValueError:
        result.error = f"malformed body: {response.text[:80]!r}"
        return
    if "error" in payload:
        result.error = f"error body: {_message(payload['error'])}"
        return
    choices = payload.get("choices") or []
    if not choices:
        result.error = "no choices"
        return
    result.ttft_s = time.perf_counter() - start  # no stream: the whole answer is the first token
    result.num_chunks = 1
    result.text_parts.append(choices[0].get("text") or (choices[0].get("message") or {}).get("content") or "")
    usage = payload.get("usage") or {}
    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
    result.output_tokens = int(usage.get("completion_tokens", 0))


def _piece(choice: dict) -> str:
    """A streamed choice's new text: a completion's ``text`` or a chat ``delta``'s ``content``."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _error_code(text: str) -> str | None:
    try:
        code = json.loads(text)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return code if isinstance(code, str) else None


def _error_message(text: str) -> str:
    try:
        return _message(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return text[:200]


def fetch_model(session: requests.Session, base_url: str, options: RequestOptions) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    response = session.get(base_url.rstrip("/") + "/v1/models", headers=headers(options), timeout=30)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models")
    return models[0]["id"]
