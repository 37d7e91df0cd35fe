"""v1 tools: the request's tools, tool_choice and messages checked (INVALID_ARGUMENT naming the
field), and what a chat request with tools needs from its model: the template's tool format, the
constraint of a required or named call, the special tokens its parser must see, and the parser
session that turns the answer into calls. The parsing itself is core.tools."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server import errors
from llama_grpc_server.core.api import EngineApi, GrammarCompiler
from llama_grpc_server.core.requests.request import Constraint, OutputParams, StoppingParams
from llama_grpc_server.core.tools import formats
from llama_grpc_server.core.tools.constraint import tool_structural_tag
from llama_grpc_server.core.tools.stream import ToolSession
from llama_grpc_server.core.tools.types import ChoiceMode, ToolChoice, ToolFormat, ToolSpec
from llama_grpc_server.rpc.shared import checks
from llama_grpc_server.rpc.v1 import validation

MAX_TOOLS = 128
TOOL_FIELD = "tool_choice"

TextRequest = pb.GenerateRequest | pb.StreamGenerateRequest

_MODES = {
    pb.TOOL_CHOICE_MODE_UNSPECIFIED: ChoiceMode.AUTO,
    pb.TOOL_CHOICE_MODE_AUTO: ChoiceMode.AUTO,
    pb.TOOL_CHOICE_MODE_NONE: ChoiceMode.NONE,
    pb.TOOL_CHOICE_MODE_REQUIRED: ChoiceMode.REQUIRED,
}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools as checked: offered only when `choice` is not NONE."""

    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = dataclasses.field(default_factory=ToolChoice)
    parallel: bool = True

    @property
    def offered(self) -> tuple[ToolSpec, ...]:
        """The tools the model is shown (none with tool_choice NONE)."""
        return () if self.choice.mode is ChoiceMode.NONE else self.tools

    @property
    def constrains(self) -> bool:
        return self.choice.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED)


def _invalid(field: str, message: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, field=field)


_json_object = validation.json_object
_name = validation.function_name


def parse_tools(message: TextRequest) -> ToolRequest:
    """The request's tools, tool_choice and parallel_tool_calls, checked."""
    if len(message.tools) > MAX_TOOLS:
        raise _invalid("tools", f"tools has {len(message.tools)} entries; at most {MAX_TOOLS}")
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for index, tool in enumerate(message.tools):
        name = _name(f"tools[{index}].name", tool.name)
        if name in seen:
            raise _invalid(f"tools[{index}].name", f"tool {name!r} is offered twice")
        seen.add(name)
        parameters: dict[str, Any] = {}
        if tool.parameters.strip():
            field = f"tools[{index}].parameters"
            parameters = _json_object(field, tool.parameters, "parameters")
            kind = parameters.get("type", "object")
            if kind != "object":
                raise _invalid(
                    field, f'parameters must be an object schema ("type": "object"), got {kind!r}'
                )
        specs.append(ToolSpec(name, tool.description, parameters))
    choice = _choice(message, seen)
    if (message.tools or choice.mode is not ChoiceMode.AUTO) and not message.messages:
        raise _invalid("tools" if message.tools else TOOL_FIELD, "tools apply to messages only")
    if choice.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED):
        if not specs:
            raise _invalid(TOOL_FIELD, "tool_choice requires a call, but no tools are offered")
        if message.params.WhichOneof("constraint") is not None:
            raise _invalid(
                TOOL_FIELD,
                "a required or named tool call is a constraint of its own: leave "
                f"params.{message.params.WhichOneof('constraint')} unset",
            )
    parallel = message.parallel_tool_calls if message.HasField("parallel_tool_calls") else True
    return ToolRequest(tuple(specs), choice, parallel)


def _choice(message: TextRequest, offered: set[str]) -> ToolChoice:
    kind = message.tool_choice.WhichOneof("choice")
    if kind == "function":
        name = message.tool_choice.function
        if name not in offered:
            known = ", ".join(sorted(offered)) or "none"
            raise _invalid(
                f"{TOOL_FIELD}.function",
                f"tool_choice names {name[:80]!r}, not offered (offered: {known})",
            )
        return ToolChoice(ChoiceMode.NAMED, name)
    mode = _MODES.get(message.tool_choice.mode) if kind == "mode" else ChoiceMode.AUTO
    if mode is None:
        raise _invalid(f"{TOOL_FIELD}.mode", f"unknown tool choice mode {message.tool_choice.mode}")
    return ToolChoice(mode)


# -- what a request with tools needs from its model -------------------------------------------


def tool_format(engine: EngineApi, template: str) -> ToolFormat:
    return formats.format_named(engine.tool_format(template))


def constraint(
    request: ToolRequest, fmt: ToolFormat, grammars: GrammarCompiler | None
) -> Constraint | None:
    """The constraint of a required or named call in the model's format; None for AUTO."""
    tag = tool_structural_tag(
        request.tools, request.choice, parallel=request.parallel, wrapper=fmt.call_wrapper
    )
    if tag is None:
        return None
    return checks.structural_tag_constraint(TOOL_FIELD, tag, grammars)


def shown_specials(engine: EngineApi, fmt: ToolFormat) -> tuple[tuple[int, str], ...]:
    """The format's markers that are special tokens of this model (one token whose plain
    text is empty): the output must show them for the parser to see them."""
    shown: list[tuple[int, str]] = []
    for marker in fmt.markers:
        ids = engine.tokenize(marker, add_special=False, parse_special=True)
        if len(ids) == 1 and not engine.detokenize(ids, render_special=False):
            shown.append((ids[0], marker))
    return tuple(shown)


def session(request: ToolRequest, fmt: ToolFormat, request_id: str) -> ToolSession:
    return ToolSession(fmt.parser(request.tools), request_id, parallel=request.parallel)


def with_shown(output: OutputParams, specials: tuple[tuple[int, str], ...]) -> OutputParams:
    return dataclasses.replace(output, shown_specials=specials) if specials else output


def with_stops(stopping: StoppingParams, fmt: ToolFormat) -> StoppingParams:
    """The request's stop strings and the format's (which the request's limits do not count:
    the server adds them)."""
    extra = tuple(s for s in fmt.stops if s not in stopping.stop)
    return dataclasses.replace(stopping, stop=stopping.stop + extra) if extra else stopping
