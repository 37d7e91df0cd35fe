"""`generic`: templates with no tool-call syntax of their own (the built-in Gemma 3 template,
Phi-3.5, ...). The servicer's system prompt asks such models for the bare JSON call
`{"name": ..., "arguments": {...}}`; only the bare JSON rule applies (streaming.StreamParser):
no markers, and any answer that is not wholly such calls is text."""

from __future__ import annotations

from collections.abc import Sequence

from ..streaming import StreamParser
from ..types import ToolCallParser, ToolSpec


class GenericFormat:
    name = "generic"
    markers: tuple[str, ...] = ()
    stops: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        return True

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return StreamParser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        return None


FORMAT = GenericFormat()
