"""Forced tool calls, served by structured output over the functions' parameter schemas.

``tool_choice``:
- ``"none"`` (or no tools): tools are ignored; the model answers in text;
- a named function: the output is constrained to that function's
  ``parameters`` schema, and becomes one call of it;
- ``"required"``: the output is constrained to ``{"name": ..., "arguments":
  ...}`` for one of the tools, and becomes that call;
- ``"auto"`` (OpenAI's default when tools are given): refused. Telling a
  call from text needs a parser for the model's own tool-call format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pd.sampling_params import StructuredKind, StructuredOutput
from pd.serve.openai_protocol import ChatCompletionRequest, NamedToolChoice, OpenAIError


@dataclass(frozen=True)
class ToolCallMode:
    """How a forced call's output maps to ``tool_calls``: a fixed function, or the name in the output."""

    function_name: str | None  # None: the output names the function ("required")

    def calls(self, text: str) -> list[dict] | None:
        """The ``tool_calls`` the output text makes; None if it is not a complete call (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function_name is not None:
            name, arguments = self.function_name, value
        elif isinstance(value, dict) and "name" in value and "arguments" in value:
            name, arguments = value["name"], value["arguments"]
        else:
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}]


def tool_call_mode(body: ChatCompletionRequest) -> tuple[ToolCallMode | None, StructuredOutput | None]:
    """The request's forced call and the constraint that serves it; ``(None, None)`` when it calls no tool."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise OpenAIError(400, f"tool_choice {_describe(choice)} needs tools", param="tool_choice")
        return None, None
    if choice is None or choice == "auto":
        raise OpenAIError(400, "tool_choice 'auto' (the default when tools are given) is not supported: this server "
                               "has no parser for the model's own tool-call format; use 'required', a named "
                               "function, or 'none'", param="tool_choice", code="unsupported")
    if body.structured_output() is not None:
        raise OpenAIError(400, "a forced tool call cannot be combined with another output constraint",
                          param="tool_choice")
    functions = {tool.function.name: tool.function for tool in body.tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        if name not in functions:
            raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        schema = functions[name].parameters
        return ToolCallMode(name), StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=json.dumps(schema))
    options = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions.values()]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return ToolCallMode(None), StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=json.dumps(schema))


def _describe(choice) -> str:
    return f"{{'function': {choice.function!r}}}" if isinstance(choice, NamedToolChoice) else repr(choice)
