"""`llama3_json`: Llama 3.1, 3.2 and 3.3, whose templates ask for
`{"name": function name, "parameters": dictionary of argument name and its value}`
(meta-llama-Llama-3.2-3B-Instruct.jinja; vLLM's llama_tool_parser.py, llama.cpp's former
Llama 3.x handler). The model may write `<|python_tag|>` first (a special token): everything
after it is calls, `{"name": ..., "parameters": {...}}` ("arguments" accepted too), several
separated by ';' or whitespace, streamed. What follows the calls, or anything after the tag
that is not a JSON object (Llama 3.1's built-in tools' `brave_search.call(query="...")`, code),
is text, the tag dropped. Without the tag the bare JSON rule applies (streaming.StreamParser),
which also takes "type": "function" in the object, as Llama 3.2 writes at times."""

from __future__ import annotations

from collections.abc import Sequence

from ..streaming import Step, StreamParser, dumps
from ..types import ToolCallParser, ToolSpec

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(StreamParser):
    openers = (PYTHON_TAG,)
    markers = (PYTHON_TAG,)

    def _section(self, opener: str) -> Step[None]:
        while (yield from self._peek_past_ws()) == "{":
            yield from self._skip_ws()
            if (yield from self._call_object()) is None:
                yield from self._resync()
                return
            yield from self._accept_past_ws(";")


class Llama3JsonFormat:
    name = "llama3_json"
    markers: tuple[str, ...] = (PYTHON_TAG,)
    stops: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        return "<|start_header_id|>" in template and (
            PYTHON_TAG in template or "parameters" in template
        )

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return Llama3JsonParser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        return f'{{"name": {dumps(name)}, "parameters": ', "}"


FORMAT = Llama3JsonFormat()
