"""The OpenAI-compatible HTTP schema: request models, error bodies, response shapes.

Unknown field names are refused with 400. Fields of the OpenAI schema that
this server does not implement are accepted at their neutral values and
refused, naming the field, otherwise.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

from pd.sampling_params import SamplingParams

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


class OpenAIError(Exception):
    """An error with an OpenAI-style JSON body and an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
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
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Extensions, as in vLLM.
    top_k: int | None = Field(None, ge=1)
    ignore_eos: bool = False

    def _check_neutral(self, neutral: dict[str, tuple]) -> None:
        for name, allowed in neutral.items():
            value = getattr(self, name)
            if value not in allowed:
                raise unsupported(name, value)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 16,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_Common):
    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _neutral(self) -> "CompletionRequest":
        self._check_neutral({
            "n": (1,), "echo": (False,), "best_of": (None, 1), "suffix": (None, ""),
            "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": (None, {}),
        })
        return self

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


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _neutral(self) -> "ChatCompletionRequest":
        self._check_neutral({
            "n": (1,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": (None, {}),
            "logprobs": (False,), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
            "response_format": (None, {"type": "text"}),
        })
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now() -> int:
    return int(time.time())
