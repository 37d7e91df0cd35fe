"""Tool values shared by the formats, the servicer and the constraint builder."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the caller offers: its name, description and JSON-Schema parameters
    (a dict, already parsed and checked to be an object schema)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)


class ChoiceMode(enum.Enum):
    AUTO = "auto"  # the model decides; nothing constrained
    NONE = "none"  # no call: tools are not offered to the model
    REQUIRED = "required"  # at least one call, of any offered tool (constrained)
    NAMED = "named"  # exactly a call of `ToolChoice.name` (constrained)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ChoiceMode = ChoiceMode.AUTO
    name: str = ""  # with NAMED


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete call: `arguments` is JSON text (an object) exactly as the model wrote it,
    or re-serialized when the format is not JSON (Qwen XML, Gemma 4). `index` is the index its
    deltas carried: a call abandoned midway (cut short, or its JSON invalid) keeps its index, so
    `calls` may skip one."""

    id: str
    name: str
    arguments: str
    index: int = 0


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the call at `index` (0, 1, ... in the order calls start). The first delta of
    a call carries its name (and id, filled in by the caller of the parser); later ones carry
    argument fragments. Concatenating a call's `arguments` fragments gives ToolCall.arguments."""

    index: int
    name: str = ""
    arguments: str = ""
    id: str = ""  # set on a call's first delta by the servicer's ToolSession, not by parsers


@dataclass(frozen=True, slots=True)
class Parsed:
    """What one push() (or finish()) releases: plain text for the answer, and call deltas.
    Text never contains a partial marker: text that may still become a call is held back."""

    text: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


class ToolCallParser(Protocol):
    """One request's streaming parser. push() takes the next piece of the model's text (any
    split, even inside a marker or a JSON string) and returns what can be released now;
    finish() is called once at the end and releases everything held back (a call that never
    completed is reported as far as it got). `calls` are the complete calls so far, in order;
    ToolCall.id is "" here (the servicer assigns ids)."""

    def push(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...

    @property
    def calls(self) -> Sequence[ToolCall]: ...


class ToolFormat(Protocol):
    """One model family's way of writing tool calls (one module in formats/)."""

    name: str  # "hermes", "llama3_json", ...
    # Texts the parser must see in the output that the model writes as special tokens (which
    # the engine renders as nothing by default): the servicer renders these into the text.
    markers: tuple[str, ...]
    # Texts that end the answer (stop strings added to the request's): where the model would
    # go on to write the tool's result itself (Gemma 4's <|tool_response>)
    stops: tuple[str, ...]

    def matches(self, template: str) -> bool:
        """True when a chat template writes tool calls in this format."""
        ...

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        """A fresh parser for one request offering `tools`."""
        ...

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        """For a constrained call of `name`: the text before the JSON arguments object and the
        text after it, in this format (the arguments object is filled in by the constraint);
        None when the format's arguments are not a JSON object (the constraint then forces the
        bare JSON call `{"name": ..., "arguments": {...}}`, which every parser accepts)."""
        ...
