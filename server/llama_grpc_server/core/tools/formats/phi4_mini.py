"""`phi4_mini`: Phi-4-mini (and templates asking the same: Firefunction v2's, Granite 3.3's).
Two spellings are read, as the sources disagree: `functools[{"name": ..., "arguments": {...}},
...]` (vLLM's phi4mini_tool_parser.py and its tool_chat_template_phi4_mini.jinja: "prefix
function calls with functools marker (no closing marker required)"; Firefunction v2's template)
and `<|tool_call|>` + a JSON list (or objects) + optional `<|/tool_call|>` (Phi-4-mini's own
special tokens; llama.cpp's Phi-4 pull request 12288; Granite 3.3's template asks for
`<|tool_call|>` followed by a JSON list). Objects take "arguments" or "parameters".
"functools[" is plain text, not a special token, so it is no marker; it is still never
released as text once it is complete."""

from __future__ import annotations

from collections.abc import Sequence

from ..streaming import Step, StreamParser, dumps
from ..types import ToolCallParser, ToolSpec

FUNCTOOLS = "functools["
TOOL_CALL = "<|tool_call|>"
TOOL_CALL_END = "<|/tool_call|>"


class Phi4MiniParser(StreamParser):
    openers = (FUNCTOOLS, TOOL_CALL)
    markers = (TOOL_CALL, TOOL_CALL_END)

    def _section(self, opener: str) -> Step[None]:
        if opener == FUNCTOOLS:
            if not (yield from self._call_array()):
                yield from self._resync()
            return
        first = yield from self._peek_past_ws()
        if first == "[":
            yield from self._skip_ws()
            self._pos += 1
            if not (yield from self._call_array()):
                yield from self._resync((TOOL_CALL_END,))
                return
        elif first == "{":
            while (yield from self._peek_past_ws()) == "{":
                yield from self._skip_ws()
                if (yield from self._call_object()) is None:
                    yield from self._resync((TOOL_CALL_END,))
                    return
                yield from self._accept_past_ws(",")
        elif first:
            yield from self._resync((TOOL_CALL_END,))
            return
        yield from self._accept_past_ws(TOOL_CALL_END)


class Phi4MiniFormat:
    name = "phi4_mini"
    markers: tuple[str, ...] = (TOOL_CALL, TOOL_CALL_END)
    stops: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        return "functools" in template or TOOL_CALL in template or "<|tool|>" in template

    def parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser:
        return Phi4MiniParser(tools)

    def call_wrapper(self, name: str) -> tuple[str, str] | None:
        return f'{FUNCTOOLS}{{"name": {dumps(name)}, "arguments": ', "}]"


FORMAT = Phi4MiniFormat()
