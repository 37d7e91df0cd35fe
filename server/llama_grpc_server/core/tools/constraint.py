"""`tool_choice` REQUIRED or a named function as a constraint: a structural tag (compiled to GBNF
by core.constrained.structural_tag, like any structural tag) that makes the whole answer calls in
the model's own format, each call's arguments matching its tool's schema.

A format whose arguments are a JSON object gives the text around them (`call_wrapper`:
Hermes' `<tool_call>\\n{"name": "f", "arguments": ` ... `}\\n</tool_call>`); the others (Qwen
XML, Gemma 4, the generic format) get the bare JSON call `{"name": "f", "arguments": {...}}`,
which every parser accepts when it is the whole answer. Several calls (REQUIRED with parallel
calls allowed) are separated by a newline, and their number is not bounded (as in llama.cpp
and OpenAI): a model that repeats itself may call until max_tokens. AUTO is never
constrained. Pure."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from llama_grpc_server.core.tools.types import ChoiceMode, ToolChoice, ToolSpec

Wrapper = Callable[[str], "tuple[str, str] | None"]


def arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    """The tool's parameters schema, an object schema in any case."""
    schema = dict(tool.parameters)
    return schema or {"type": "object"}


def _call(tool: ToolSpec, wrapper: Wrapper) -> dict[str, Any]:
    wrapped = wrapper(tool.name)
    if wrapped is None:
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments_schema(tool)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        return {"type": "json_schema", "json_schema": schema}
    begin, end = wrapped
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": begin},
            {"type": "json_schema", "json_schema": arguments_schema(tool)},
            {"type": "const_string", "value": end},
        ],
    }


def tool_structural_tag(
    tools: Sequence[ToolSpec], choice: ToolChoice, *, parallel: bool, wrapper: Wrapper
) -> str | None:
    """The structural tag (JSON text) constraining the answer to calls, or None when the
    choice constrains nothing (AUTO, NONE)."""
    if choice.mode is ChoiceMode.NAMED:
        chosen = [t for t in tools if t.name == choice.name]
        return _tag(_call(chosen[0], wrapper))
    if choice.mode is not ChoiceMode.REQUIRED:
        return None
    calls = [_call(t, wrapper) for t in tools]
    one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if not parallel:
        return _tag(one)
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, one]}
    return _tag({"type": "sequence", "elements": [one, {"type": "star", "content": more}]})


def _tag(form: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)
