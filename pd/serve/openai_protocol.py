"""The OpenAI-compatible HTTP schema: request models, error bodies, response shapes.

Unknown field names are refused with 400. Fields of the OpenAI schema that
ask for no behaviour (``store``, ``metadata``, ``service_tier``, ``user``,
``parallel_tool_calls``) are accepted at any value; fields that would change
the output and are not implemented are accepted only at their neutral values
and refused otherwise, naming the field. Unknown keys inside
``stream_options`` are ignored, as OpenAI's clients add new ones freely.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

from pd.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, StructuredKind, StructuredOutput

# Seeds seed a torch.Generator: a signed 64-bit integer (SamplingParams checks the same).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _unicode(text: str) -> str:
    """Refuse text that is not valid Unicode (JSON can carry lone surrogates such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text holds {text[exc.start:exc.end]!a}, a lone surrogate, which is not valid Unicode") from None
    return text


# Text that becomes tokens or is matched against them: valid Unicode only.
Text = Annotated[str, AfterValidator(_unicode)]
# Token ids: integers, never booleans.
TokenIds = list[StrictInt]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class OpenAIError(Exception):
    """An error with an OpenAI-style JSON body and an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers  # sent with the response (a 429's Retry-After)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(field: str, value: Any) -> OpenAIError:
    return OpenAIError(400, f"{field}={value!r} is not supported by this server", param=field, code="unsupported")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    # vLLM's extension: usage in every chunk, not only in a last one.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


def _schema_text(schema: dict[str, Any] | str, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise OpenAIError(400, f"{field} is not valid JSON: {exc}", param=field) from None
    if not isinstance(schema, dict):
        raise OpenAIError(400, f"{field} must be a JSON schema object", param=field)
    return json.dumps(schema)


class LoadLoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``, as vLLM takes it: the adapter's name (a request's ``model``) and the
    peft directory it loads from."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Accepted at any value: they ask for no behaviour of the model.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # Extensions, as in vLLM.
    top_k: int | None = Field(None, ge=1)
    ignore_eos: bool = False
    # Lower is more urgent (the engines' scheduling order); unset: 0, or the tenant's default under flow control.
    priority: StrictInt | None = Field(None, gt=-2**31, lt=2**31)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)

    def _check_neutral(self, neutral: dict[str, tuple]) -> None:
        for name, allowed in neutral.items():
            value = getattr(self, name)
            if value not in allowed:
                raise unsupported(name, value)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def constraint_fields(self) -> list[str]:
        """The fields that constrain the output, as given."""
        given = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        return given

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the output must follow, from ``response_format`` or a ``guided_*`` extension."""
        given = self.constraint_fields()
        if len(given) > 1:
            raise OpenAIError(400, f"give at most one output constraint; got {', '.join(given)}", param=given[1])
        if not given:
            return None
        if given[0] == "guided_json":
            return StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=_schema_text(self.guided_json, "guided_json"))
        if given[0] == "guided_regex":
            return StructuredOutput(kind=StructuredKind.REGEX, spec=self.guided_regex)
        if given[0] == "guided_choice":
            return StructuredOutput(kind=StructuredKind.CHOICE, spec=json.dumps(self.guided_choice))
        if self.response_format.type == "json_object":
            return StructuredOutput(kind=StructuredKind.JSON_OBJECT)
        schema = _schema_text(self.response_format.json_schema.json_schema, "response_format.json_schema.schema")
        return StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=schema)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutput | None = None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 16,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
        )


class CompletionRequest(_Common):
    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    # 0 asks for nothing to generate: with echo, only the prompt's scores come back.
    max_tokens: int | None = Field(None, ge=0)
    logprobs: TopK | None = None
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # vLLM's extension: the prompt's own scores, the top k at each position and the prompt's token (not streamed).
    prompt_logprobs: TopK | None = None

    @model_validator(mode="after")
    def _neutral(self) -> "CompletionRequest":
        self._check_neutral({
            "suffix": (None, ""), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": (None, {}),
        })
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise OpenAIError(400, "max_tokens=0 asks for nothing; it is only allowed with echo=true or "
                              "prompt_logprobs", param="max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise OpenAIError(400, "prompt_logprobs cannot be streamed; ask without stream, or use echo with "
                              "logprobs", param="prompt_logprobs")
        if self.best_of is not None and self.best_of < self.n:
            raise OpenAIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.best_of not in (None, self.n) and self.stream:
            raise OpenAIError(400, "best_of > n cannot be streamed", param="best_of")
        return self

    def prompt_scores_k(self) -> int | None:
        """How many alternatives the engine scores at each prompt position: for ``echo`` with ``logprobs``
        and for ``prompt_logprobs``, the larger (None: the prompt is not scored)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, "only text content parts are supported", param="messages")
            try:
                parts.append(_unicode(part["text"]))
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="messages") from None
        return "".join(parts)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: dict[Literal["name"], str]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: TopK | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Accepted at any value: a forced tool choice makes exactly one call, which either value allows.
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _neutral(self) -> "ChatCompletionRequest":
        self._check_neutral({"presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": (None, {})})
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them; ``developer`` is the newer name of ``system``."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def now() -> int:
    return int(time.time())
