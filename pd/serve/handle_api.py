"""Typed requests and chunks for calling the app from another Ray app through a handle.

    handle = serve.get_app_handle("pd")
    async for chunk in handle.options(stream=True).generate.remote(GenerateRequest(prompt="Hi")):
        print(chunk.text, end="")
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pd.serve.openai_protocol import Seed, Text, TokenIds


class GenerateRequest(BaseModel):
    """A prompt (text or token ids) or chat messages, plus sampling settings."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # a LoRA adapter's name (or the base model's); None: the base model
    prompt: Text | TokenIds | None = None
    messages: list[dict[str, Text]] | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: Seed | None = None
    stop: list[Text] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    # Lower is more urgent; unset: 0, or the default tenant's default under flow control.
    priority: int | None = Field(None, gt=-2**31, lt=2**31)

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class GenerateChunk(BaseModel):
    """New tokens and their text; the last chunk has ``finish_reason`` and ``usage``."""

    token_ids: list[int]
    text: str
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
